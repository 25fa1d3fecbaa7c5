# Writes OUT (a header with the git revision of SOURCE_DIR) at every build, touching it only when
# the revision changed, so that `llmtrain info` never reports a stale revision.
set(revision "unknown")
find_package(Git QUIET)
if(GIT_FOUND AND EXISTS "${SOURCE_DIR}/.git")
  execute_process(COMMAND ${GIT_EXECUTABLE} describe --always --dirty --abbrev=10
                  WORKING_DIRECTORY ${SOURCE_DIR} OUTPUT_VARIABLE out OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE status ERROR_QUIET)
  if(status EQUAL 0 AND out)
    set(revision "${out}")
  endif()
endif()
set(content "// Generated at build time by cmake/git_revision.cmake.\n#pragma once\nnamespace llmtrain::build {\ninline constexpr const char* git_revision = \"${revision}\";\n}\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL content)
  file(WRITE "${OUT}" "${content}")
endif()
