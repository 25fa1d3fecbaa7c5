// What the rest of llmtrain may ask of MPI without including its headers.
#pragma once

#include <string>

namespace llmtrain::dist {

/// The MPI library's own version line ("Open MPI v4.1.4, ..."), or "not built".
std::string mpi_library_version();

}  // namespace llmtrain::dist
