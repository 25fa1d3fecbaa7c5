#include "dist/mpi_runtime.h"

#if LLMTRAIN_HAVE_MPI
#include <mpi.h>
#endif

namespace llmtrain::dist {

std::string mpi_library_version() {
#if LLMTRAIN_HAVE_MPI
  // One of the few MPI calls allowed before MPI_Init.
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<std::size_t>(length));
  if (const auto end = version.find_first_of(",\n"); end != std::string::npos) version.resize(end);
  return version;
#else
  return "not built";
#endif
}

}  // namespace llmtrain::dist
