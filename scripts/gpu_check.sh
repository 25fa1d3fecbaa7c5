#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU, offline, with nothing but a C++ compiler, python3
# and the CUDA pieces, from the system or as Python wheels: builds llmtrain for this GPU only,
# runs the Catch2 test cases tagged [cuda], trains GPT-2 124M (T=1024) with each attention path
# (our flash attention, cuDNN's), and prints one table. The whole run keeps to one deadline
# (--budget): the build is capped so that the [cuda] tests and the benchmark keep their needs
# after it, and they get those first; the sanitizer and the kernel table share what they leave.
# The needs are measured on the last run in this build folder, else estimated; what no longer
# fits is skipped for time (a test binary still running at the tests' deadline is stopped, its
# finished cases kept), and the table says so.
#
# Two modes. --quick (the default unless the budget holds the full mode) needs 3 minutes after the
# build (4.5 with the sanitizer): the [cuda] cases of the ops and the model (test_ops,
# test_cuda_ops, test_cuda_model), then one bf16 training row per attention path at one
# micro-batch (16 unless --batches names one); no PyTorch, no kernel table. --full (the default
# where the budget holds it) runs the [cuda] cases of every test
# binary, searches the largest micro-batch that fits for each attention path, trains the same
# model in PyTorch (bf16 autocast, SDPA, fused AdamW, torch.compile), profiles each path (nsys
# where it works, else llmtrain's --profile-ops), and times every op of the step with
# bench/bench_kernels against the GPU's ceilings. In both, where compute-sanitizer is found and
# time is left, racecheck and synccheck run over the flash attention [cuda] cases. The table also
# goes to --out as JSON, with a log of whatever failed beside it (FILE.failures.log).
#
# Where things are looked for (first found wins; every missing piece is listed at once, one line each):
#   nvcc     $CUDA_HOME/bin, /usr/local/cuda/bin, the PATH, the wheels (nvidia/cu13/bin, nvidia/cuda_nvcc/bin)
#   CUDA     beside nvcc (lib64, targets/*/lib, lib), the wheels nvidia.cuda_runtime and nvidia.cublas
#   NVRTC    libnvrtc.so.N beside the CUDA runtime or in the wheels (nvidia.cu13, nvidia.cuda_nvrtc):
#            cuDNN compiles its attention engines with it at run time (without it: no cudnn row)
#   NCCL     $NCCL_HOME, beside nvcc, /usr and /usr/local, the wheel nvidia.nccl
#   cuDNN    $CUDNN_HOME, beside nvcc, /usr and /usr/local, the wheel nvidia.cudnn (optional: without
#            it the cudnn row is skipped)
#   wheels   asked of $PYTHON: where the packages nvidia.cu13, nvidia.nccl, nvidia.cudnn... live
#   headers  nlohmann/json, CLI11, Catch2 v2: the system's, else third_party/ (scripts/vendor_deps.sh,
#            run where the packages are and carried along); the network is never used
# Then discovery compiles a three-line probe (.cu) with the nvcc and host compiler found, linked as
# the build will link (the static CUDA runtime, else the shared one where a wheel has no
# libcudart_static.a), and runs it: it names the driver's CUDA version (which must not be older
# than the toolkit's) and the devices it sees. nvcc --version alone proves little: CUDA 13 wheels
# split the crt headers and libnvvm into wheels of their own.
# Wheels ship libraries under versioned names only (libnccl.so.2, libcudnn.so.9, libcudart.so.13):
# they are passed to CMake by full path, and their folders go on LD_LIBRARY_PATH for the runs.
# Without mpicxx the build has no MPI (one GPU needs none); without OpenBLAS the CPU matmul is slow
# (unused here). Only this GPU's architecture is compiled (90 where there is no GPU), with one job
# per core.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--build-only] [--quick|--full] [--out FILE] [--budget SECONDS]
#          [--build-dir DIR] [--steps N] [--precision bf16|fp32] [--batches 64,32,16,8,4,2,1]
#          [--attention flash,cudnn] [--skip-tests] [--skip-bench] [--skip-pytorch] [--skip-kernels]
#          [--skip-sanitizer]
#   --dry-run     find everything (the probe included), list what is missing, print the commands
#   --build-only  find, configure and build (no GPU needed), then stop (the build may take the budget)
#   --quick, --full  the modes above (default: --full where the budget holds a build of about 240 s
#                 and the full mode's stages at their needs, about 1050 s with PyTorch; else --quick)
#   --out FILE    the table as JSON (default BUILD_DIR/gpu_check/gpu_check.json), with "status"
#   --budget S    the time the whole check may take, build included (default 480: 8 minutes, which
#                 runs --quick: a build of up to 290 s, then about 270 s of stages)
# Environment: JOBS (default: nproc), CUDA_ARCHS (default: the GPU's compute capability),
#   PEAK_TFLOPS (a GPU this script does not know), CUDA_HOME, NCCL_HOME, CUDNN_HOME,
#   LLMTRAIN_VENDOR_DIR (default: third_party/), PYTHON (default: python3), EXTRA_CMAKE_ARGS
#   (more -D flags for the configure step, split on spaces; they come last and win),
#   GPU_CHECK_TIME_SCALE (tests of the deadline logic only: budget seconds per real second),
#   GPU_CHECK_FAKE_CLOCK (tests of the deadline logic only: an absolute path to a file holding the
#   clock in microseconds, read in place of the real one here and by scripts/lib/gpu_bench.py; only
#   the stubs under test move it, so load cannot stretch it. A command capped at a deadline gets it
#   in GPU_CHECK_FAKE_DEADLINE, in the same microseconds, instead of timeout(1), and must stop there
#   with exit status 124, as timeout would have stopped it).
# Status (the last line, and "status" in the JSON) and exit status: "passed" (0) when the build,
#   every stage and every benchmark row ran and passed; "failed" (1) when anything failed, also
#   when no GPU is usable, every [cuda] case skipped or the build was stopped at its cap;
#   "incomplete (out of time)" (3) when nothing failed but a stage, a test binary or a benchmark
#   row was skipped or stopped for time (the last line names which); 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

dry_run=0 build_only=0 skip_tests=0 skip_bench=0 skip_pytorch=0 skip_kernels=0 skip_sanitizer=0 mode=""
build_dir=build-gpu steps="" precision=bf16 batches="" attention="flash,cudnn" budget=480 out=""
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --build-only) build_only=1 ;;
    --quick) mode=quick ;;
    --full) mode=full ;;
    --skip-tests) skip_tests=1 ;;
    --skip-bench) skip_bench=1 ;;
    --skip-pytorch) skip_pytorch=1 ;;
    --skip-kernels) skip_kernels=1 ;;
    --skip-sanitizer) skip_sanitizer=1 ;;
    --out) out="${2:?--out needs a file}"; shift ;;
    --budget) budget="${2:?--budget needs seconds}"; shift ;;
    --build-dir) build_dir="${2:?--build-dir needs a folder}"; shift ;;
    --steps) steps="${2:?--steps needs a number}"; shift ;;
    --precision) precision="${2:?--precision needs bf16 or fp32}"; shift ;;
    --batches) batches="${2:?--batches needs a list such as 64,32,16}"; shift ;;
    --attention) attention="${2:?--attention needs a list such as flash,cudnn}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$budget" =~ ^[0-9]+$ && "$budget" -ge 60 ]] || { echo "gpu_check.sh: --budget: expected seconds >= 60" >&2; exit 2; }
[[ -z "$steps" || ( "$steps" =~ ^[0-9]+$ && "$steps" -ge 5 ) ]] || { echo "gpu_check.sh: --steps: expected a number >= 5" >&2; exit 2; }
[[ "$precision" == bf16 || "$precision" == fp32 ]] || { echo "gpu_check.sh: --precision: bf16 or fp32" >&2; exit 2; }
[[ -z "$batches" || "$batches" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "gpu_check.sh: --batches: expected numbers separated by commas" >&2; exit 2; }
[[ "$attention" =~ ^(flash|cudnn)(,(flash|cudnn))*$ ]] || { echo "gpu_check.sh: --attention: flash, cudnn or both" >&2; exit 2; }
scale="${GPU_CHECK_TIME_SCALE:-1}"
[[ "$scale" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: GPU_CHECK_TIME_SCALE: a whole number >= 1" >&2; exit 2; }
fake_clock="${GPU_CHECK_FAKE_CLOCK:-}"
[[ -z "$fake_clock" || ( "$fake_clock" == /* && "$(cat "$fake_clock" 2>/dev/null)" =~ ^[1-9][0-9]*$ ) ]] ||
  { echo "gpu_check.sh: GPU_CHECK_FAKE_CLOCK: an absolute path to a file holding microseconds" >&2; exit 2; }

# The clock, in budget seconds (real seconds times GPU_CHECK_TIME_SCALE) since the start.
now_us() {  # (bash 5's EPOCHREALTIME, else date; the file's under GPU_CHECK_FAKE_CLOCK)
  if [[ -n "$fake_clock" ]]; then echo "$(<"$fake_clock")"; return; fi
  if [[ -n "${EPOCHREALTIME:-}" ]]; then echo "${EPOCHREALTIME/./}"; else echo $(( $(date +%s%N) / 1000 )); fi
}
start_us=$(now_us)
spent() { echo $(( ($(now_us) - start_us) * scale / 1000000 )); }
left() { echo $(( budget - $(spent) )); }
# real SECONDS: budget seconds as real seconds (for timeout and for the Python helpers' clocks).
real() { printf '%d.%03d' $(( $1 / scale )) $(( ($1 % scale) * 1000 / scale )); }
# epoch_in S: the epoch time (real seconds) S budget seconds from now, for the Python helpers.
epoch_in() { local us=$(( $(now_us) + $1 * 1000000 / scale )); printf '%d.%06d' $((us / 1000000)) $((us % 1000000)); }
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
logs="$build_dir/gpu_check"
out="${out:-$logs/gpu_check.json}"
problems=()    # what stops the check: one line each
notes=()       # what is missing but only shrinks the table
found=()       # where each piece was found (printed by --dry-run and in the JSON)
stages=()      # "name=status" rows of the table beyond the build, the tests and the kernels
status_build="not run" status_tests="not run" bench_error="" status_kernels="not run"
status_sanitizer="not run"

say() { echo "gpu_check: $*" >&2; }
elapsed() { local s; s=$(spent); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
# first_lib NAME DIR...: DIR/libNAME.so, else DIR's libNAME.so.N (wheels ship only that), first DIR that has one.
first_lib() {
  local name="$1" dir file; shift
  for dir in "$@"; do
    [[ -n "$dir" && -d "$dir" ]] || continue
    [[ -e "$dir/lib$name.so" ]] && { echo "$dir/lib$name.so"; return 0; }
    file="$(compgen -G "$dir/lib$name.so.[0-9]*" | sort -V | head -n 1 || true)"  # libnccl.so.2 before .so.2.27.3
    [[ -n "$file" ]] && { echo "$file"; return 0; }
  done
  return 1
}
# find_pair HEADER LIB "INCDIR|LIBDIR[:LIBDIR]"...: "INCDIR|LIBRARY" of the first pair that has both.
find_pair() {
  local header="$1" lib="$2" pair inc file; shift 2
  for pair in "$@"; do
    inc="${pair%%|*}"
    [[ -n "$inc" && -f "$inc/$header" ]] || continue
    IFS=: read -r -a dirs <<< "${pair#*|}"
    file="$(first_lib "$lib" "${dirs[@]}")" || continue
    echo "$inc|$file"; return 0
  done
  return 1
}

# ---- discovery -----------------------------------------------------------------------------------
declare -A wheel=()   # nvidia.NAME -> its folder, as the interpreter sees it
have_python=0 have_torch=0
if command -v "$python" >/dev/null; then
  have_python=1
  while read -r name path; do [[ -n "$name" ]] && wheel[$name]="$path"; done < <("$python" - 2>/dev/null <<'PY' || true
import importlib.util
for name in ("cu13", "cuda_nvcc", "cuda_runtime", "cuda_nvrtc", "cublas", "nccl", "cudnn"):
    try:
        spec = importlib.util.find_spec("nvidia." + name)
    except (ImportError, ValueError):
        continue
    if spec is not None and spec.submodule_search_locations:
        print(name, list(spec.submodule_search_locations)[0])
PY
)
  "$python" -c "import torch" 2>/dev/null && have_torch=1
  for name in "${!wheel[@]}"; do found+=("wheel nvidia.$name: ${wheel[$name]}"); done
  # cmake and ninja installed as wheels sit beside the interpreter.
  python_bin="$(dirname "$(command -v "$python")")"
  [[ ":$PATH:" == *":$python_bin:"* ]] || PATH="$PATH:$python_bin"
else
  problems+=("$python not found (the wheels are asked of it, and the benchmark and the table need it; set PYTHON)")
fi
w() { [[ -n "${wheel[$1]:-}" ]] && echo "${wheel[$1]}$2"; return 0; }

command -v cmake >/dev/null || problems+=("cmake not found (on the PATH or beside $python)")
command -v c++ >/dev/null || command -v g++ >/dev/null || problems+=("no C++ compiler (c++ or g++) on the PATH")
generator=()
if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi

nvcc=""
for candidate in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)" \
                 "$(w cu13 /bin/nvcc)" "$(w cuda_nvcc /bin/nvcc)"; do
  if [[ -n "$candidate" && -x "$candidate" ]]; then nvcc="$candidate"; break; fi
done
cuda_root="" nvcc_version="?"
cuda_inc=() cuda_lib=()
if [[ -z "$nvcc" ]]; then
  problems+=("nvcc not found (\$CUDA_HOME/bin, /usr/local/cuda/bin, the PATH, or the wheel nvidia-cuda-nvcc / cuda-toolkit of $python)")
else
  cuda_root="$(cd "$(dirname "$nvcc")/.." && pwd)"
  nvcc_version="$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' || true)"
  if [[ -n "$nvcc_version" ]]; then
    found+=("nvcc $nvcc_version: $nvcc")
  else
    problems+=("$nvcc does not run (nvcc --version failed)")
  fi
  for d in "$cuda_root"/targets/*-linux/include "$cuda_root/include" "$(w cuda_runtime /include)" "$(w cublas /include)"; do
    [[ -d "$d" ]] && cuda_inc+=("$d")
  done
  for d in "$cuda_root/lib64" "$cuda_root"/targets/*-linux/lib "$cuda_root/lib" "$(w cuda_runtime /lib)" "$(w cublas /lib)" \
           "$(w cuda_nvrtc /lib)"; do
    [[ -d "$d" ]] && cuda_lib+=("$d")
  done
fi
system_inc=(/usr/include /usr/local/include)
system_lib=("/usr/lib/$(uname -m)-linux-gnu" /usr/lib64 /usr/lib /usr/local/lib)
cmake_flags=(-DCMAKE_BUILD_TYPE=Release -DLLMTRAIN_CUDA=ON -DBUILD_TESTING=ON)
run_libs=()     # folders the built binaries load libraries from

# The CUDA runtime and cuBLAS(Lt): beside nvcc or in the wheels. A versioned-only library (a wheel)
# is handed to FindCUDAToolkit by full path, which otherwise looks for libcublasLt.so.
if [[ -n "$nvcc" ]]; then
  cmake_flags+=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$cuda_root")
  for lib in cudart cublas cublasLt; do
    if path="$(first_lib "$lib" "${cuda_lib[@]}")"; then
      found+=("$lib: $path")
      run_libs+=("$(dirname "$path")")
      # (FindCUDAToolkit calls the runtime CUDA_CUDART first, CUDA_cudart_LIBRARY after.)
      [[ "$path" == *.so ]] || cmake_flags+=("-DCUDA_${lib}_LIBRARY=$path")
      [[ "$path" == *.so || "$lib" != cudart ]] || cmake_flags+=(-DCUDA_CUDART="$path")
    else
      problems+=("lib$lib.so not found beside $nvcc (lib64, targets/*/lib, lib) nor in the wheels nvidia.cuda_runtime / nvidia.cublas")
    fi
  done
  if ! header_dir="$(for d in "${cuda_inc[@]}"; do [[ -f "$d/cublasLt.h" ]] && echo "$d" && break; done)" || [[ -z "$header_dir" ]]; then
    problems+=("cublasLt.h not found beside $nvcc nor in the wheel nvidia.cublas")
  fi
  cccl=0  # CUDA's C++ library (cuda_fp16.h includes <nv/target>): the toolkit's include/cccl, or include/
  for d in "${cuda_inc[@]}"; do [[ -f "$d/cccl/nv/target" || -f "$d/nv/target" ]] && cccl=1; done
  ((cccl)) || problems+=("CCCL headers (nv/target) not found beside $nvcc: the wheel nvidia-cuda-cccl, or a full toolkit")
  # NVRTC: cuDNN's runtime-compiled attention engines load libnvrtc.so.N (nothing links it).
  if path="$(first_lib nvrtc "${cuda_lib[@]}" "$(w cu13 /lib)")"; then
    found+=("NVRTC: $path")
    run_libs+=("$(dirname "$path")")
  else
    notes+=("libnvrtc.so not found beside $nvcc nor in the wheels nvidia.cu13 / nvidia.cuda_nvrtc: cuDNN cannot compile its attention engines, so the cudnn row and cuDNN's [cuda] cases will report a refusal")
  fi
  # nvcc links the static CUDA runtime from lib64 beside it; a wheel has lib/ only, and may have no
  # libcudart_static.a at all: then the shared runtime, as CMake does (CMakeLists.txt) and the probe.
  cudart_mode=static
  static="$(compgen -G "$cuda_root/lib64/libcudart_static.a" || compgen -G "$cuda_root/lib/libcudart_static.a" ||
            compgen -G "$cuda_root/targets/*-linux/lib/libcudart_static.a" ||
            compgen -G "$(w cuda_runtime /lib)/libcudart_static.a" || true)"
  static="${static%%$'\n'*}"
  if [[ -z "$static" ]]; then
    cudart_mode=shared
    notes+=("libcudart_static.a not found beside $nvcc nor in the wheel nvidia.cuda_runtime: the probe and the build link the shared CUDA runtime")
  elif [[ "$(dirname "$static")" != "$cuda_root/lib64" ]]; then
    LIBRARY_PATH="$(dirname "$static")${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export LIBRARY_PATH
  fi
fi

# NCCL (required: the multi-GPU communicator is part of the CUDA build) and cuDNN (optional).
lib_path() { local IFS=:; echo "$*"; }
nccl_pairs=("${NCCL_HOME:+$NCCL_HOME/include|$NCCL_HOME/lib:$NCCL_HOME/lib64}")
cudnn_pairs=("${CUDNN_HOME:+$CUDNN_HOME/include|$CUDNN_HOME/lib:$CUDNN_HOME/lib64}")
for inc in "${cuda_inc[@]}" "${system_inc[@]}"; do
  nccl_pairs+=("$inc|$(lib_path "${cuda_lib[@]}" "${system_lib[@]}")")
  cudnn_pairs+=("$inc|$(lib_path "${cuda_lib[@]}" "${system_lib[@]}")")
done
[[ -n "${wheel[nccl]:-}" ]] && nccl_pairs+=("${wheel[nccl]}/include|${wheel[nccl]}/lib")
[[ -n "${wheel[cudnn]:-}" ]] && cudnn_pairs+=("${wheel[cudnn]}/include|${wheel[cudnn]}/lib")
if nccl="$(find_pair nccl.h nccl "${nccl_pairs[@]}")"; then
  cmake_flags+=(-DNCCL_INCLUDE_DIR="${nccl%%|*}" -DNCCL_LIBRARY="${nccl#*|}")
  run_libs+=("$(dirname "${nccl#*|}")")
  found+=("NCCL: ${nccl%%|*}/nccl.h, ${nccl#*|}")
else
  problems+=("NCCL not found (nccl.h and libnccl.so[.2]: \$NCCL_HOME, beside nvcc, /usr, /usr/local, or the wheel nvidia-nccl-cu13 of $python)")
fi
if cudnn="$(find_pair cudnn.h cudnn "${cudnn_pairs[@]}")"; then
  cmake_flags+=(-DLLMTRAIN_CUDNN=ON -DCUDNN_INCLUDE_DIR="${cudnn%%|*}" -DCUDNN_LIBRARY="${cudnn#*|}")
  run_libs+=("$(dirname "${cudnn#*|}")")  # libcudnn.so.9 loads its engines from its own folder
  found+=("cuDNN: ${cudnn%%|*}/cudnn.h, ${cudnn#*|}")
else
  cmake_flags+=(-DLLMTRAIN_CUDNN=OFF)
  notes+=("cuDNN not found (cudnn.h and libcudnn.so[.9]: \$CUDNN_HOME, beside nvcc, /usr, /usr/local, or the wheel nvidia-cudnn-cu13): built without it, no cudnn row")
  attention="$(tr , '\n' <<< "$attention" | grep -v cudnn | paste -sd, -)"
fi

# Header-only libraries: the system's, else the vendor folder. Never downloaded here.
vendor_dir="${LLMTRAIN_VENDOR_DIR:-$repo/third_party}"
use_vendor=0
for header in nlohmann/json.hpp CLI/CLI.hpp catch2/catch.hpp; do
  alternative="$header"
  [[ "$header" == catch2/catch.hpp ]] && alternative=catch2/catch_all.hpp  # Catch2 v3's package
  where=""
  for root in "${system_inc[@]}"; do
    [[ -f "$root/$header" || -f "$root/$alternative" ]] && { where="$root/$header"; break; }
  done
  if [[ -z "$where" && -f "$vendor_dir/include/$header" ]]; then where="$vendor_dir/include/$header"; use_vendor=1; fi
  if [[ -n "$where" ]]; then
    found+=("$header: $where")
  else
    problems+=("$header: not installed and not in $vendor_dir (run scripts/vendor_deps.sh where the packages are; carry third_party/)")
  fi
done
((use_vendor)) && cmake_flags+=(-DLLMTRAIN_VENDOR_DIR="$vendor_dir")

mpi="ON"
if [[ ! -x "$(command -v mpicxx || true)" ]]; then  # (command -v also names a file that cannot run)
  mpi="OFF"
  cmake_flags+=(-DLLMTRAIN_MPI=OFF)
fi
read -r -a extra_cmake_args <<< "${EXTRA_CMAKE_ARGS:-}"
cmake_flags+=("${extra_cmake_args[@]}")
for flag in "${extra_cmake_args[@]}"; do
  [[ "$flag" =~ ^-DLLMTRAIN_MPI(:BOOL)?=(.*)$ ]] && mpi="${BASH_REMATCH[2]}"
done

gpu_name="" archs="${CUDA_ARCHS:-}" gpu_count=0 gpu_memory_mib="" driver=""
if command -v nvidia-smi >/dev/null && gpus="$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
    --format=csv,noheader,nounits 2>/dev/null)" && [[ -n "$gpus" ]]; then
  gpu_count=$(wc -l <<< "$gpus")
  IFS=',' read -r gpu_name _ gpu_memory_mib driver <<< "$(head -n 1 <<< "$gpus")"
  gpu_name="$(xargs <<< "$gpu_name")" gpu_memory_mib="$(xargs <<< "$gpu_memory_mib")" driver="$(xargs <<< "$driver")"
  # Every distinct compute capability present, "9.0" -> "90".
  [[ -n "$archs" ]] || archs="$(cut -d, -f2 <<< "$gpus" | tr -d ' .' | sort -u | paste -sd';' -)"
  ((gpu_count == 1)) || say "$gpu_count GPUs: the tests and the benchmark use the first (CUDA_VISIBLE_DEVICES picks another)"
  found+=("GPU: $gpu_name x$gpu_count, sm $archs, $gpu_memory_mib MiB, driver $driver")
elif ((dry_run || build_only)); then
  notes+=("no GPU here (nvidia-smi missing or lists none): fine for --dry-run and --build-only; building for sm ${archs:-90}")
else
  problems+=("no GPU: nvidia-smi is missing or lists no device")
fi
archs="${archs:-90}"
cmake_flags+=(-DCMAKE_CUDA_ARCHITECTURES="$archs")
torch_wanted=$((!skip_pytorch))  # (the note about it waits for the mode: --quick has no PyTorch row)
((have_torch)) || skip_pytorch=1

# The built binaries find the wheels' libraries through this.
if ((${#run_libs[@]})); then
  LD_LIBRARY_PATH="$(printf '%s\n' "${run_libs[@]}" | awk '!seen[$0]++' | paste -sd: -)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi

# ---- the probe: three lines of CUDA through the nvcc and host compiler found, linked as the build
# links (static or shared runtime), then run: the driver's CUDA version and the devices it sees ----
# nvcc's host compiler is g++ from the PATH unless told otherwise; CMake's is the same.
host_cxx="$(command -v g++ || true)"
if [[ -z "$host_cxx" ]] && host_cxx="$(command -v c++)"; then cmake_flags+=(-DCMAKE_CUDA_HOST_COMPILER="$host_cxx"); fi
probe_text="not run" driver_cuda="" probe_devices=""
if [[ -n "$nvcc" && -n "$nvcc_version" && -n "$host_cxx" ]]; then
  probe_dir="$(mktemp -d)"
  trap 'rm -rf "$probe_dir"' EXIT
  cat > "$probe_dir/probe.cu" <<'CU'
#include <cstdio>
__global__ void probe_kernel(int* p) { *p = 42; }
int main() { int runtime = 0, driver = 0, devices = 0, value = 0, *p = nullptr; cudaRuntimeGetVersion(&runtime); cudaDriverGetVersion(&driver); cudaError_t e = cudaGetDeviceCount(&devices); if (e == cudaSuccess && devices > 0 && (e = cudaMalloc(&p, sizeof(int))) == cudaSuccess) { probe_kernel<<<1, 1>>>(p); if ((e = cudaMemcpy(&value, p, sizeof(int), cudaMemcpyDeviceToHost)) == cudaSuccess && value != 42) e = cudaErrorUnknown; } std::printf("runtime %d driver %d devices %d kernel %s\n", runtime, driver, devices, value == 42 ? "ran" : cudaGetErrorString(e)); return 0; }
CU
  probe_link=(-cudart "$cudart_mode")
  if [[ "$cudart_mode" == shared ]]; then  # a wheel's libcudart.so.N, under the name the linker asks for
    mkdir -p "$probe_dir/link"
    runtime_so="$(first_lib cudart "${cuda_lib[@]}" || true)"
    [[ -n "$runtime_so" ]] && ln -sf "$runtime_so" "$probe_dir/link/libcudart.so"
    probe_link+=(-L"$probe_dir/link")
    [[ -n "$runtime_so" ]] && probe_link+=(-L"$(dirname "$runtime_so")")
  fi
  probe_arch="${archs:-90}"
  probe_arch="${probe_arch%%;*}"
  probe_cmd=("$nvcc" -ccbin "$host_cxx" -arch=sm_"$probe_arch" "${probe_link[@]}" -o "$probe_dir/probe" "$probe_dir/probe.cu")
  echo "+ ${probe_cmd[*]}" >&2
  if ! timeout 120 "${probe_cmd[@]}" > "$probe_dir/compile.log" 2>&1; then
    problems+=("the probe (three lines of CUDA) does not compile and link with $nvcc, host compiler $host_cxx, $cudart_mode CUDA runtime: $(grep -m 1 -iE 'error|cannot|fatal' "$probe_dir/compile.log" || tail -n 1 "$probe_dir/compile.log")")
    probe_text="FAILED: does not compile or link"
  elif ! probe_out="$(timeout 60 "$probe_dir/probe" 2>&1)" ||
       ! [[ "$probe_out" =~ ^runtime\ ([0-9]+)\ driver\ ([0-9]+)\ devices\ ([0-9]+)\ kernel\ (.*)$ ]]; then
    problems+=("the probe compiled but did not run: ${probe_out:-no output}")
    probe_text="FAILED: does not run"
  else
    runtime_v="${BASH_REMATCH[1]}" driver_v="${BASH_REMATCH[2]}" probe_devices="${BASH_REMATCH[3]}" kernel="${BASH_REMATCH[4]}"
    cuda_v() { echo "$(($1 / 1000)).$(($1 % 1000 / 10))"; }
    probe_text="compiled and linked (sm_$probe_arch, $cudart_mode runtime $(cuda_v "$runtime_v"), host compiler $host_cxx)"
    found+=("probe: $probe_text")
    no_gpu_ok=$((dry_run || build_only))
    if ((driver_v == 0)); then
      probe_text+="; no CUDA driver"
      if ((no_gpu_ok)); then notes+=("no CUDA driver here (the probe's cudaDriverGetVersion gives 0): fine for --dry-run and --build-only")
      else problems+=("no CUDA driver: the probe's cudaDriverGetVersion gives 0 (is libcuda.so.1 loadable?)"); fi
    else
      driver_cuda="$(cuda_v "$driver_v")"
      probe_text+="; driver supports CUDA $driver_cuda, $probe_devices device(s), kernel: $kernel"
      if ((driver_v / 1000 < runtime_v / 1000)); then
        problems+=("the driver supports CUDA $driver_cuda, older than the toolkit's $(cuda_v "$runtime_v"): every [cuda] case would skip; update the driver or use a CUDA $((driver_v / 1000)) toolkit")
      elif ((driver_v < runtime_v)); then
        notes+=("the driver supports CUDA $driver_cuda, the toolkit is $(cuda_v "$runtime_v"): minor-version compatibility (sm_$probe_arch code runs, PTX for newer targets cannot be compiled by this driver)")
      fi
      if ((probe_devices == 0)) && ((!no_gpu_ok)); then
        problems+=("no device: the probe sees none ($kernel)")
      elif ((probe_devices > 0)) && [[ "$kernel" != ran ]]; then
        problems+=("the probe's kernel (sm_$probe_arch) did not run on device 0: $kernel")
      fi
    fi
  fi
fi
stages+=("probe=$probe_text")

# ---- the plan: the mode, each stage's need in budget seconds ---------------------------------------
sanitizer=""  # compute-sanitizer: its stage is planned only where it is found
for candidate in "$(command -v compute-sanitizer || true)" "${cuda_root:+$cuda_root/bin/compute-sanitizer}" \
                 "${cuda_root:+$cuda_root/compute-sanitizer/compute-sanitizer}" /usr/local/cuda/compute-sanitizer/compute-sanitizer \
                 "$(w cu13 /bin/compute-sanitizer)" "$(w cu13 /compute-sanitizer/compute-sanitizer)"; do
  if [[ -n "$candidate" && -x "$candidate" ]]; then sanitizer="$candidate"; break; fi
done
# Needs: estimates, replaced by what the stage took on the last run in this build folder (in that
# mode) when it ran to its end; stage_seconds.txt keeps them. The benchmark: per attention path one
# run (quick) or a micro-batch search and a profile (full), PyTorch's compile and run on top.
bench_paths=$(tr , '\n' <<< "$attention" | grep -c .)
needs_file="$logs/stage_seconds.txt"
report_reserve=10       # the table and the JSON at the end
build_allowance=240     # what a build from scratch of the quick mode's targets takes on a node (estimate)
declare -A need=()
set_needs() {  # set_needs MODE: need[] and row_need for MODE (PyTorch as that mode would run it)
  local q=0 m stage seconds
  [[ "$1" == quick ]] && q=1
  if ((q)); then need=([tests]=100 [kernels]=0 [sanitizer]=90); else need=([tests]=200 [kernels]=60 [sanitizer]=120); fi
  row_need=$(( q ? 40 : 60 ))
  need[bench]=$(( q ? row_need * bench_paths : 135 * bench_paths + (skip_pytorch ? 0 : 150) ))
  if [[ -f "$needs_file" ]]; then
    while read -r m stage seconds; do
      [[ "$m" == "$1" && -n "${need[$stage]+x}" && "$seconds" =~ ^[0-9]+$ ]] && need[$stage]=$((seconds * 6 / 5 + 5))
    done < "$needs_file"
  fi
}
mandatory=(tests bench)  # the build's cap keeps their needs; the other stages share what they leave
planned() {  # planned MODE: the stages MODE would run, in order
  ((skip_tests)) || echo tests
  ((skip_bench)) || echo bench
  [[ "$1" == quick ]] || ((skip_kernels)) || echo kernels
  ((skip_sanitizer)) || [[ -z "$sanitizer" ]] || echo sanitizer
}
total_need() { local t=0 s; for s in "$@"; do t=$((t + need[$s])); done; echo "$t"; }
# The default mode: --full where the budget holds a build and every stage of the full mode at its
# need, else --quick (whose stages fit the default budget).
set_needs full
mapfile -t plan < <(planned full)
full_needs=$(( report_reserve + build_allowance + $(total_need "${plan[@]}") ))
if [[ -z "$mode" ]]; then
  if ((budget >= full_needs)); then mode=full; else mode=quick; fi
  mode_why="default for --budget $budget: the full mode needs about $full_needs s"
fi
quick=0
[[ "$mode" == quick ]] && quick=1
# Quick: one micro-batch, fewer steps, no PyTorch, no profile, no kernel table.
if ((quick)); then
  steps="${steps:-15}" batches="${batches:-16}"
  batches="${batches%%,*}"
  skip_pytorch=1 skip_kernels=1
else
  steps="${steps:-30}" batches="${batches:-64,32,16,8,4,2,1}"
  ((torch_wanted && have_python && !have_torch)) && notes+=("PyTorch not importable by $python: no PyTorch row")
fi
set_needs "$mode"
mapfile -t plan < <(planned "$mode")   # the stages after the build, in order
mode_needs=$(( report_reserve + build_allowance + $(total_need "${plan[@]}") ))
if ((mode_needs > budget && !build_only)); then
  notes+=("the $mode mode needs about $mode_needs s (a build of about $build_allowance s, then $(for s in "${plan[@]}"; do printf '%s %s s, ' "$s" "${need[$s]}"; done | sed 's/, $//')) and the budget is $budget s: what does not fit is skipped for time (give a larger --budget$( ((quick)) || echo ", or --quick"))")
fi

gpus_text="no GPU"
((gpu_count)) && gpus_text="$gpu_name x$gpu_count"
header="GPU check ($mode, budget ${budget} s): $gpus_text (sm $archs, ${gpu_memory_mib:-?} MiB, driver ${driver:-?}${driver_cuda:+, CUDA $driver_cuda}), nvcc ${nvcc_version}, MPI $mpi, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"

for f in "${found[@]}"; do say "found: $f"; done
for n in "${notes[@]}"; do say "note: $n"; done
for p in "${problems[@]}"; do say "missing: $p"; done
((${#problems[@]})) || say "nothing missing"
((${#problems[@]} == 0)) && ((dry_run)) && [[ -n "${LD_LIBRARY_PATH:-}" ]] && say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
say "the $mode mode${mode_why:+ ($mode_why)}: $(for s in "${plan[@]}"; do printf '%s %s s, ' "$s" "${need[$s]}"; done | sed 's/, $//')"

declare -A measured=()  # stage -> seconds, for the stages that ran to their end this time
is_mandatory() { [[ " ${mandatory[*]} " == *" $1 "* ]]; }
# slice STAGE: its share of the time left (less the report's). The tests and the benchmark come
# first: those still to run share min(left, their needs) by need, and more only where the time left
# holds every stage still to come (then all of them share it by need); the sanitizer and the kernel
# table share what the tests and the benchmark still to run leave.
slice() {
  local stage="$1" s on=0 m=0 o=0 l pool
  for s in "${plan[@]}"; do
    [[ "$s" == "$stage" ]] && on=1
    ((on)) || continue
    if is_mandatory "$s"; then m=$((m + need[$s])); else o=$((o + need[$s])); fi
  done
  l=$(( $(left) - report_reserve ))
  ((l > 0 && m + o > 0)) || { echo 0; return; }
  pool=$(( l < m ? l : m ))                                   # the tests' and the benchmark's
  (( l * m / (m + o) > pool )) && pool=$(( l * m / (m + o) ))
  if is_mandatory "$stage"; then
    echo $(( pool * need[$stage] / m ))
  else
    echo $(( (l - pool) * need[$stage] / o ))
  fi
}
# fits STAGE SLICE MIN: true when SLICE is at least MIN; else says why not in the stage's status.
skipped_for_time() { echo "skipped for time: $1 s of the budget left for it, it needs about $2 s"; }
# run_capped LOG CAP CMD...: CMD with its output in LOG, stopped after CAP budget seconds (exit 124).
# Under GPU_CHECK_FAKE_CLOCK, CMD (a stub) is handed its deadline and keeps to it itself.
run_capped() {
  local log="$1" cap="$2"; shift 2
  if [[ -n "$fake_clock" ]]; then
    GPU_CHECK_FAKE_DEADLINE=$(( $(now_us) + cap * 1000000 / scale )) "$@" > "$log" 2>&1
    return
  fi
  timeout --kill-after=5 "$(real "$cap")" "$@" > "$log" 2>&1
}

# ---- the table and the JSON ---------------------------------------------------------------------
tests_json="" suite_json="" kernels_json=""
out_of_time=()  # the stages skipped or cut short for time
# finish EXIT_CODE: the table, the JSON, the failure log, the measured needs; then exits with
# EXIT_CODE, or 3 where it is 0 but a stage ran out of time. The status (the JSON's and the last
# line's): passed (0), failed (1), incomplete (out of time) (3).
finish() {
  local code="$1" status ran_out
  if [[ -n "${shard_pid:-}" ]]; then kill "$shard_pid" 2>/dev/null || true; wait "$shard_pid" 2>/dev/null || true; fi  # (no build)
  ((code == 0 && ${#out_of_time[@]})) && code=3
  case "$code" in 0) status=passed ;; 3) status="incomplete (out of time)" ;; *) status=failed ;; esac
  ran_out="$(printf '%s, ' "${out_of_time[@]}")"
  ran_out="${ran_out%, }"
  local args=(--header "$header, $(elapsed) of ${budget} s" --build "$status_build" --tests "$status_tests"
              --status "$status" --out-of-time "$ran_out")
  [[ -n "$tests_json" && -f "$tests_json" ]] && args+=(--tests-json "$tests_json")
  [[ -n "$suite_json" && -f "$suite_json" ]] && args+=(--suite "$suite_json")
  [[ -n "$bench_error" ]] && args+=(--bench-error "$bench_error")
  args+=(--kernels-status "$status_kernels")
  [[ -n "$kernels_json" && -f "$kernels_json" ]] && args+=(--kernels "$kernels_json")
  stages+=("sanitizer=$status_sanitizer")
  for s in "${stages[@]}"; do args+=(--stage "$s"); done
  for p in "${problems[@]}"; do args+=(--problem "$p"); done
  for n in "${notes[@]}"; do args+=(--note "$n"); done
  for f in "${found[@]}"; do args+=(--found "$f"); done
  if ((!dry_run)); then
    mkdir -p "$(dirname "$out")"
    args+=(--json "$out" --failures-log "${out%.json}.failures.log" --logs "$logs" --ld-library-path "${LD_LIBRARY_PATH:-}")
    if ((${#measured[@]})) && [[ -d "$logs" ]]; then
      { [[ -f "$needs_file" ]] && grep -v "^$mode " "$needs_file"
        for s in "${!measured[@]}"; do echo "$mode $s ${measured[$s]}"; done; } > "$needs_file.new" || true
      mv -f "$needs_file.new" "$needs_file" 2>/dev/null || true
    fi
  fi
  if ((have_python)); then
    "$python" scripts/lib/gpu_bench.py report "${args[@]}" || true
  fi
  ((dry_run)) || say "table: $out; failures: ${out%.json}.failures.log"
  if ((dry_run)); then
    say "status: dry run, nothing run ($(( ${#problems[@]} )) missing)"
  else
    say "status: $status${ran_out:+ ($([[ $status == failed ]] && echo "also out of time" || echo "skipped or cut short for time"): $ran_out)}"
  fi
  exit "$code"
}
failed=0

if ((${#problems[@]})); then
  if ((!dry_run)); then
    status_build="not run: ${#problems[@]} missing piece(s), listed above"
    status_tests="not run: no build" bench_error="not run: no build" status_kernels="not run: no build"
    status_sanitizer="not run: no build"
    finish 1
  fi
  say "dry run: continuing to show what would run"
  failed=1
fi
((dry_run)) || mkdir -p "$logs"

# ---- build ---------------------------------------------------------------------------------------
# Only llmtrain and the test binaries that hold [cuda] cases (--quick: the ops' and the model's).
quick_tests=(test_ops test_cuda_ops test_cuda_model)
targets=(llmtrain)
((skip_kernels)) || targets+=(bench_kernels)
if ((!skip_tests)); then
  mapfile -t test_targets < <("${python}" - 2>/dev/null <<'PY' || true
import os, re
text = open("tests/CMakeLists.txt").read()
for name, body in re.findall(r"llmtrain_add_test\((\w+)\s+SOURCES\s+(.*?)(?:\s+LIBS\b|\))", text, re.S):
    if any("[cuda]" in open(os.path.join("tests", s)).read() for s in body.split() if s.endswith(".cpp")):
        print(name)
PY
)
  if ((quick)); then
    mapfile -t test_targets < <(printf '%s\n' "${test_targets[@]}" | grep -xF -f <(printf '%s\n' "${quick_tests[@]}") || true)
  fi
  targets+=("${test_targets[@]}")
fi
# The build's cap: the budget less the report's reserve and the needs of the tests and the benchmark
# (the sanitizer and the kernel table get only what they leave); 30 s at the least. --build-only
# keeps nothing for them.
after_build=0
for s in "${plan[@]}"; do is_mandatory "$s" && ((!build_only)) && after_build=$((after_build + need[$s])); done
build_cap=$(( $(left) - report_reserve - after_build ))
((build_cap < 30)) && build_cap=30
# The benchmark's synthetic tokens (a few seconds of Python), written while the build runs.
data="$logs/data" shard_pid=""
if ((!skip_bench)); then
  echo "+ $python scripts/lib/gpu_bench.py shard $data --tokens 2097152 --vocab 50257" >&2
  if ((!dry_run)) && [[ ! -f "$data/train_000000.bin" ]]; then
    "$python" scripts/lib/gpu_bench.py shard "$data" --tokens 2097152 --vocab 50257 > "$logs/shard.log" 2>&1 &
    shard_pid=$!
  fi
fi
build_start=$(spent)
echo "+ cmake -S . -B $build_dir ${generator[*]} ${cmake_flags[*]}" >&2
echo "+ cmake --build $build_dir -j $jobs --target ${targets[*]}    (capped at ${build_cap} s)" >&2
if ((dry_run)); then
  status_build="not run (dry run); it would be capped at ${build_cap} s"
elif run_capped "$logs/configure.log" "$build_cap" cmake -S . -B "$build_dir" "${generator[@]}" "${cmake_flags[@]}" &&
     run_capped "$logs/build.log" $((build_cap - ($(spent) - build_start))) \
       cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"; then
  status_build="ok: sm $archs, -j$jobs, $(($(spent) - build_start)) s of its cap of ${build_cap} s, $cudart_mode CUDA runtime, targets ${targets[*]}"
else
  code=$?
  took=$(($(spent) - build_start))
  tail -n 30 "$logs/configure.log" "$logs/build.log" 2>/dev/null >&2 || true
  if ((code == 124 || code == 137)) || ((took >= build_cap)); then
    status_build="FAILED: stopped at its cap of ${build_cap} s (the budget of ${budget} s keeps ${after_build} s for the [cuda] tests and the benchmark); what was built is kept in $build_dir: rerun, or give a larger --budget"
  else
    status_build="FAILED after ${took} s: see $logs/configure.log and $logs/build.log"
  fi
  status_tests="not run: no build" bench_error="not run: no build" status_kernels="not run: no build"
  status_sanitizer="not run: no build"
  finish 1
fi
if ((build_only)); then
  status_tests="not run (--build-only)" bench_error="not run (--build-only)" status_kernels="not run (--build-only)"
  status_sanitizer="not run (--build-only)"
  finish 0
fi

# The benchmark's synthetic tokens were written (a few seconds of Python) while the build ran.
if [[ -n "$shard_pid" ]] && ! wait "$shard_pid"; then
  bench_error="FAILED: the synthetic tokens were not written: $(tail -n 1 "$logs/shard.log")"
  skip_bench=1 failed=1
fi
shard_pid=""

# ---- [cuda] tests: one deadline across the binaries (the ops' and the model's first) --------------
if ((skip_tests)); then
  status_tests="skipped (--skip-tests)"
else
  tests_slice=$(slice tests)
  tests_cmd=("$python" scripts/lib/gpu_bench.py cuda-tests --build "$build_dir" --binaries "$(IFS=,; echo "${quick_tests[*]}")"
             --out "$logs/cuda_tests.json")
  ((quick)) || tests_cmd+=(--and-the-rest)
  echo "+ ${tests_cmd[*]} --deadline <${tests_slice} s from now>" >&2
  if ((dry_run)); then
    status_tests="not run (dry run)"
  elif ((tests_slice < 30)); then
    status_tests="$(skipped_for_time "$tests_slice" 30)"
    out_of_time+=("[cuda] tests")
  else
    tests_start=$(spent)
    tests_json="$logs/cuda_tests.json"
    code=0
    "${tests_cmd[@]}" --deadline "$(epoch_in "$tests_slice")" --time-scale "$scale" > "$logs/cuda_tests.txt" 2>&1 || code=$?
    took="$(($(spent) - tests_start)) s of its ${tests_slice} s"
    if ((code == 0)); then
      status_tests="ok: $(head -n 1 "$logs/cuda_tests.txt"), $took"
      measured[tests]=$(($(spent) - tests_start))
    elif ((code == 3)); then  # nothing failed; a binary stopped at the deadline, or not run for it
      status_tests="incomplete (out of time): $(head -n 1 "$logs/cuda_tests.txt"), $took"
      out_of_time+=("[cuda] tests")
    else
      failed=1
      status_tests="FAILED: $(head -n 1 "$logs/cuda_tests.txt"), $took (details: $logs/cuda_tests.txt, $build_dir/tests/*.cuda-tests.xml)"
      grep -q "skipped for time" "$logs/cuda_tests.txt" && out_of_time+=("[cuda] tests")
    fi
    sed -n '2,$p' "$logs/cuda_tests.txt" >&2
  fi
fi

# ---- benchmark: llmtrain with each attention path (then PyTorch on the same shapes, --full) ---------
if ((skip_bench)); then
  bench_error="${bench_error:-skipped (--skip-bench)}"
else
  bench_slice=$(slice bench)
  suite_cmd=("$python" scripts/lib/gpu_bench.py suite --binary "$build_dir/src/llmtrain" --config configs/gpt2-124m.json
             --data "$data" --gpu-name "${gpu_name:-unknown}" --batches "$batches" --steps "$steps"
             --precision "$precision" --attention "$attention" --row-estimate "$row_need"
             --workdir "$logs" --out "$logs/suite.json")
  ((skip_pytorch)) || suite_cmd+=(--pytorch "$python")
  ((quick)) && suite_cmd+=(--profile-steps 0)
  echo "+ ${suite_cmd[*]} --deadline <${bench_slice} s from now>" >&2
  if ((dry_run)); then
    bench_error="not run (dry run)"
  elif ((bench_slice < 30)); then
    bench_error="$(skipped_for_time "$bench_slice" "$row_need")"
    out_of_time+=(benchmark)
  else
    bench_start=$(spent)
    suite_json="$logs/suite.json"
    code=0
    "${suite_cmd[@]}" --deadline "$(epoch_in "$bench_slice")" --time-scale "$scale" || code=$?
    ((code == 0 || code == 3)) || failed=1
    if "$python" -c 'import json, sys; sys.exit(1 if json.load(open(sys.argv[1])).get("skipped") else 0)' "$suite_json" 2>/dev/null; then
      measured[bench]=$(($(spent) - bench_start))
    else
      out_of_time+=(benchmark)  # a row, PyTorch or a profile skipped for time (the table's "skipped:" lines)
    fi
  fi
fi

# ---- every kernel against its ceiling (bench/bench_kernels), beside the training table (--full) ----
if ((skip_kernels)); then
  status_kernels="skipped ($( ((quick)) && echo "--quick" || echo "--skip-kernels"))"
else
  kernels_cmd=("$build_dir/bench/bench_kernels" --batch 8 --json "$logs/kernels.json")
  kernels_slice=$(slice kernels)
  echo "+ ${kernels_cmd[*]}" >&2
  if ((dry_run)); then
    status_kernels="not run (dry run)"
  elif ((kernels_slice < 20)); then
    status_kernels="$(skipped_for_time "$kernels_slice" "${need[kernels]}")"
    out_of_time+=(kernels)
  else
    kernels_start=$(spent)
    kernels_json="$logs/kernels.json"
    rm -f "$kernels_json"
    if run_capped "$logs/kernels.txt" "$kernels_slice" "${kernels_cmd[@]}"; then
      status_kernels="ok: $(($(grep -c . "$logs/kernels.txt") - 2)) ops, $(($(spent) - kernels_start)) s (details: $logs/kernels.txt)"
      measured[kernels]=$(($(spent) - kernels_start))
    else
      code=$?
      if ((code == 124 || code == 137)); then  # still running at the end of its slice
        status_kernels="skipped for time: stopped at the end of its ${kernels_slice} s, the table unfinished (details: $logs/kernels.txt)"
        out_of_time+=(kernels)
      else
        failed=1
        status_kernels="FAILED (exit $code) after $(($(spent) - kernels_start)) s: $(tail -n 1 "$logs/kernels.txt") (details: $logs/kernels.txt)"
      fi
    fi
  fi
fi

# ---- compute-sanitizer racecheck and synccheck over the flash attention [cuda] cases ---------------
if ((skip_sanitizer)); then
  status_sanitizer="skipped (--skip-sanitizer)"
elif [[ -z "$sanitizer" ]]; then
  status_sanitizer="skipped: compute-sanitizer not found (beside nvcc, the PATH, the wheel nvidia.cu13)"
else
  sanitizer_slice=$(slice sanitizer)
  sanitizer_target=("$build_dir/tests/test_ops" "[cuda][flash]")
  for tool in racecheck synccheck; do echo "+ $sanitizer --tool $tool --error-exitcode 99 ${sanitizer_target[*]}" >&2; done
  if ((dry_run)); then
    status_sanitizer="not run (dry run)"
  elif ((skip_tests)) || [[ ! -x "${sanitizer_target[0]}" ]]; then
    status_sanitizer="not run: ${sanitizer_target[0]} not built"
  elif ((sanitizer_slice < 30)); then
    status_sanitizer="$(skipped_for_time "$sanitizer_slice" "${need[sanitizer]}")"
    out_of_time+=(sanitizer)
  else
    sanitizer_start=$(spent) parts=() complete=1
    for tool in racecheck synccheck; do
      cap=$((sanitizer_slice - ($(spent) - sanitizer_start)))
      [[ "$tool" == racecheck ]] && cap=$((sanitizer_slice / 2))
      log="$logs/sanitizer_$tool.txt"
      code=0
      run_capped "$log" "$cap" "$sanitizer" --tool "$tool" --error-exitcode 99 "${sanitizer_target[@]}" || code=$?
      summary="$(grep -m 1 -oE '(RACECHECK|SYNCCHECK|ERROR) SUMMARY: .*' "$log" | sed 's/^=* *//' || true)"
      if ((code == 0)); then
        parts+=("$tool ok (${summary:-no summary})")
      elif ((code == 124 || code == 137)); then
        complete=0
        parts+=("$tool stopped at its ${cap} s, nothing reported before that")
        grep -qE "[1-9][0-9]* (hazards|errors)" <<< "$summary" && { failed=1; parts[-1]="$tool FAILED: $summary (stopped at its ${cap} s)"; }
      else
        failed=1
        parts+=("$tool FAILED (exit $code): ${summary:-$(tail -n 1 "$log")} (details: $log)")
      fi
    done
    joined="$(printf '%s; ' "${parts[@]}")"
    status_sanitizer="${joined%; }, $(($(spent) - sanitizer_start)) s"
    if ((complete)); then measured[sanitizer]=$(($(spent) - sanitizer_start)); else out_of_time+=(sanitizer); fi
  fi
fi
finish "$failed"
