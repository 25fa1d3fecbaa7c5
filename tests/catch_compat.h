// Catch2 v2 (Debian 12) and v3 (Ubuntu 24.04) behind one include.
#pragma once

#include <iostream>

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define LLMTRAIN_CATCH_V3 1
#else
#include <catch2/catch.hpp>
#define LLMTRAIN_CATCH_V3 0
#endif

// Skips the rest of a test case visibly. ctest marks a test whose output contains "SKIPPED:"
// as skipped (tests/CMakeLists.txt), with either Catch2 version.
#if LLMTRAIN_CATCH_V3
#define LLMTRAIN_SKIP(reason)                            \
  do {                                                   \
    std::cout << "SKIPPED: " << (reason) << std::endl;   \
    SKIP(reason);                                        \
  } while (0)
#else
#define LLMTRAIN_SKIP(reason)                            \
  do {                                                   \
    std::cout << "SKIPPED: " << (reason) << std::endl;   \
    WARN("SKIPPED: " << (reason));                       \
    return;                                              \
  } while (0)
#endif
