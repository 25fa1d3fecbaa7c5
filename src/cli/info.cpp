// llmtrain info: what this binary was built with and what it finds at run time.
#include <iostream>
#include <thread>

#include "cli/commands.h"
#include "llmtrain/build_info.h"
#include "llmtrain/git_revision.h"
#include "core/strings.h"
#include "dist/mpi_runtime.h"
#if LLMTRAIN_HAVE_CUDA
#include "device/runtime.h"
#endif

#if LLMTRAIN_HAVE_OPENBLAS
// OpenBLAS's own introspection; declared here because the cblas.h found first may be another BLAS's.
extern "C" char* openblas_get_config(void);
extern "C" int openblas_get_num_threads(void);
#endif

namespace llmtrain::cli {
namespace {

void print_row(const char* key, const std::string& value) {
  std::cout << "  " << key << std::string(12 - std::string(key).size(), ' ') << value << "\n";
}

int run_info() {
  std::cout << "llmtrain " << build::version << " (git " << build::git_revision << ")\n";
  std::cout << "build\n";
  print_row("type", std::string(build::build_type) + ", " + build::cxx_compiler + ", C++20");
#if LLMTRAIN_HAVE_CUDA
  print_row("cuda", "runtime " + device::runtime_version() + ", archs " + build::cuda_archs);
  print_row("cublaslt", device::cublaslt_version());
  print_row("cudnn", device::cudnn_version());
  print_row("nccl", device::nccl_version());
#else
  print_row("cuda", "not built (CPU-only build)");
#endif
  print_row("mpi", dist::mpi_library_version());
#if LLMTRAIN_HAVE_OPENBLAS
  print_row("blas", std::string(openblas_get_config()) + ", " +
                        std::to_string(openblas_get_num_threads()) + " threads");
#else
  print_row("blas", "none: CPU matmul is a plain OpenMP loop (slow; built without OpenBLAS)");
#endif

  std::cout << "runtime\n";
  print_row("cpu threads", std::to_string(std::thread::hardware_concurrency()));
#if LLMTRAIN_HAVE_CUDA
  print_row("cuda driver", device::driver_version());
  const device::DeviceReport report = device::query_devices();
  if (report.devices.empty()) print_row("devices", "no CUDA device: " + report.why_none);
  for (const auto& d : report.devices) {
    print_row(("cuda:" + std::to_string(d.index)).c_str(),
              d.name + ", sm_" + std::to_string(d.compute_major) + std::to_string(d.compute_minor) + ", " +
                  std::to_string(d.multiprocessors) + " SMs, " + format_bytes(double(d.total_memory)));
  }
#else
  print_row("devices", "cpu only");
#endif
  return 0;
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("info", "Print version, build features and the devices found");
  return {app, run_info};
}

}  // namespace llmtrain::cli
