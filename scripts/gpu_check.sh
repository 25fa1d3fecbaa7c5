#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds llmtrain for the GPU present, runs every
# Catch2 test case tagged [cuda], benchmarks GPT-2 124M training (T=1024, the largest micro-batch
# of 64, 32, 16, ... that fits) and prints one table: tokens/s, MFU, peak GPU and host memory,
# and the 10 most expensive kernels (nsys where installed, else llmtrain's own op times).
#
# Needs only a C++20 compiler with OpenMP, CMake, python3 and the CUDA toolkit with NCCL; works
# offline. Header-only libraries the system lacks come from third_party/ (scripts/vendor_deps.sh,
# run where the packages or the internet are, then copied along); without mpicxx the build has
# no MPI (one GPU needs none). Only this GPU's architecture is compiled, with one job per core,
# and the CPU-only configuration is skipped, so that it fits in 8 minutes on one H100/H200 (16
# cores); the table's header gives the time it took.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--build-dir DIR] [--steps N] [--precision fp32|bf16]
#                             [--batches 64,32,16,8,4,2,1] [--skip-tests] [--skip-bench]
#   --dry-run   check the tools, print what would run and the table's rows; needs no GPU
# Environment: JOBS (default: nproc), CUDA_ARCHS (default: the GPUs' compute capabilities),
#   PEAK_TFLOPS (a GPU this script does not know), NCCL_HOME (NCCL outside the CUDA toolkit),
#   LLMTRAIN_VENDOR_DIR (default: third_party/), PYTHON (default: python3), EXTRA_CMAKE_ARGS
#   (more -D flags for the configure step, split on spaces; they come last and win).
# Exit status: 0 when the build, every [cuda] test and the benchmark passed; 1 otherwise; 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

dry_run=0 skip_tests=0 skip_bench=0
# fp32 until the bf16 mixed-precision path exists (the trainer refuses bf16 so far).
build_dir=build-gpu steps=30 precision="fp32" batches="64,32,16,8,4,2,1"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --skip-tests) skip_tests=1 ;;
    --skip-bench) skip_bench=1 ;;
    --build-dir) build_dir="${2:?--build-dir needs a folder}"; shift ;;
    --steps) steps="${2:?--steps needs a number}"; shift ;;
    --precision) precision="${2:?--precision needs bf16 or fp32}"; shift ;;
    --batches) batches="${2:?--batches needs a list such as 64,32,16}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$steps" =~ ^[0-9]+$ && "$steps" -ge 5 ]] || { echo "gpu_check.sh: --steps: expected a number >= 5" >&2; exit 2; }
[[ -z "$precision" || "$precision" == bf16 || "$precision" == fp32 ]] || { echo "gpu_check.sh: --precision: bf16 or fp32" >&2; exit 2; }
[[ "$batches" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "gpu_check.sh: --batches: expected numbers separated by commas" >&2; exit 2; }

start=$SECONDS
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
logs="$build_dir/gpu_check"
problems=()    # what stops the check (missing tools)
status_build="not run" status_tests="not run" bench_error=""

say() { echo "gpu_check: $*" >&2; }
elapsed() { local s=$((SECONDS - start)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
# show_and_run LOG CMD...: prints the command; runs it (output to LOG) unless this is a dry run.
show_and_run() {
  local log="$1"; shift
  echo "+ $*" >&2
  ((dry_run)) && return 0
  "$@" > "$log" 2>&1
}

# ---- preflight: tools -------------------------------------------------------------------------
command -v "$python" >/dev/null || problems+=("$python not found (the benchmark and the table need it; set PYTHON)")
command -v cmake >/dev/null || problems+=("cmake not found")
command -v c++ >/dev/null || command -v g++ >/dev/null || problems+=("no C++ compiler (c++ or g++) on the PATH")
nvcc=""
for candidate in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
  if [[ -n "$candidate" && -x "$candidate" ]]; then nvcc="$candidate"; break; fi
done
[[ -n "$nvcc" ]] || problems+=("nvcc not found (set CUDA_HOME, or put the CUDA toolkit's bin on the PATH)")
cuda_root="${nvcc:+$(dirname "$(dirname "$nvcc")")}"
nvcc_version="$([[ -n "$nvcc" ]] && "$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p' || echo '?')"

gpu_name="" archs="${CUDA_ARCHS:-}" gpu_count=0 gpu_memory_mib="" driver=""
if command -v nvidia-smi >/dev/null && gpus="$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version \
    --format=csv,noheader,nounits 2>/dev/null)" && [[ -n "$gpus" ]]; then
  gpu_count=$(wc -l <<< "$gpus")
  IFS=',' read -r gpu_name _ gpu_memory_mib driver <<< "$(head -n 1 <<< "$gpus")"
  gpu_name="$(xargs <<< "$gpu_name")" gpu_memory_mib="$(xargs <<< "$gpu_memory_mib")" driver="$(xargs <<< "$driver")"
  # Every distinct compute capability present, "9.0" -> "90".
  [[ -n "$archs" ]] || archs="$(cut -d, -f2 <<< "$gpus" | tr -d ' .' | sort -u | paste -sd';' -)"
  ((gpu_count == 1)) || say "$gpu_count GPUs: the tests and the benchmark use the first (CUDA_VISIBLE_DEVICES picks another)"
else
  problems+=("no GPU: nvidia-smi is missing or lists no device")
fi

# NCCL is part of the CUDA build (the multi-GPU communicator); it ships apart from the toolkit.
nccl_flags=()
if [[ -n "${NCCL_HOME:-}" ]]; then
  nccl_flags=(-DNCCL_INCLUDE_DIR="$NCCL_HOME/include" -DNCCL_LIBRARY="$(find "$NCCL_HOME"/lib* -maxdepth 1 -name 'libnccl.so*' 2>/dev/null | sort | head -n 1)")
else
  nccl_found=0
  for candidate in "${cuda_root:-/nonexistent}"/include/nccl.h "${cuda_root:-/nonexistent}"/targets/*/include/nccl.h \
                   /usr/include/nccl.h /usr/local/include/nccl.h; do
    [[ -f "$candidate" ]] && nccl_found=1
  done
  ((nccl_found)) || problems+=("NCCL not found (nccl.h beside the CUDA toolkit or in /usr/include): install libnccl-dev, or set NCCL_HOME")
fi

# Header-only libraries: the system's, else the vendor folder (filled now where it is missing).
vendor_dir="${LLMTRAIN_VENDOR_DIR:-$repo/third_party}"
cmake_flags=(-DCMAKE_BUILD_TYPE=Release -DLLMTRAIN_CUDA=ON -DBUILD_TESTING=ON)
[[ -n "$nvcc" ]] && cmake_flags+=(-DCMAKE_CUDA_COMPILER="$nvcc")
[[ -n "$archs" ]] && cmake_flags+=(-DCMAKE_CUDA_ARCHITECTURES="$archs")
missing_headers=()
for header in nlohmann/json.hpp CLI/CLI.hpp catch2/catch.hpp; do
  alternative="$header"
  [[ "$header" == catch2/catch.hpp ]] && alternative=catch2/catch_all.hpp  # Catch2 v3's package
  for root in /usr/include /usr/local/include; do
    [[ -f "$root/$header" || -f "$root/$alternative" ]] && continue 2
  done
  missing_headers+=("$header")
done
need_vendor=0
if ((${#missing_headers[@]})); then
  for header in "${missing_headers[@]}"; do [[ -f "$vendor_dir/include/$header" ]] || need_vendor=1; done
  cmake_flags+=(-DLLMTRAIN_VENDOR_DIR="$vendor_dir")
fi
mpi="ON"
if ! command -v mpicxx >/dev/null; then
  mpi="OFF"
  cmake_flags+=(-DLLMTRAIN_MPI=OFF)
fi
cmake_flags+=("${nccl_flags[@]}")
read -r -a extra_cmake_args <<< "${EXTRA_CMAKE_ARGS:-}"
cmake_flags+=("${extra_cmake_args[@]}")
for flag in "${extra_cmake_args[@]}"; do
  [[ "$flag" =~ ^-DLLMTRAIN_MPI(:BOOL)?=(.*)$ ]] && mpi="${BASH_REMATCH[2]}"
done

gpus_text="no GPU"
((gpu_count)) && gpus_text="$gpu_name x$gpu_count"
header="GPU check: $gpus_text (sm ${archs:-?}, ${gpu_memory_mib:-?} MiB, driver ${driver:-?}), nvcc ${nvcc_version}, MPI $mpi, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"

finish() {  # finish EXIT_CODE: the table, then exit
  local tests_line="$status_tests"
  "$python" scripts/lib/gpu_bench.py report ${bench_json:+--bench "$bench_json"} ${bench_error:+--bench-error "$bench_error"} \
    --tests "$tests_line" --build "$status_build" --header "$header, $(elapsed)" || true
  exit "$1"
}
bench_json=""
failed=0

if ((${#problems[@]})); then
  for p in "${problems[@]}"; do say "missing: $p"; done
  if ((!dry_run)); then
    status_build="not run: ${problems[0]}"
    bench_error="not run: ${problems[0]}"
    if command -v "$python" >/dev/null; then finish 1; fi
    exit 1
  fi
  say "dry run: continuing to show what would run"
fi
((dry_run)) || mkdir -p "$logs"

# ---- build ---------------------------------------------------------------------------------------
if ((need_vendor)); then
  say "headers missing from the system and $vendor_dir: ${missing_headers[*]}; filling it"
  show_and_run "$logs/vendor.log" scripts/vendor_deps.sh "$vendor_dir" || {
    cat "$logs/vendor.log" >&2
    status_build="FAILED: ${missing_headers[*]} missing and scripts/vendor_deps.sh could not fetch them (log: $logs/vendor.log)"
    bench_error="not run: no build"; finish 1
  }
fi
build_start=$SECONDS
if show_and_run "$logs/configure.log" cmake -S . -B "$build_dir" "${cmake_flags[@]}" &&
   show_and_run "$logs/build.log" cmake --build "$build_dir" -j "$jobs"; then
  status_build="ok: sm ${archs:-?}, -j$jobs, $((SECONDS - build_start)) s (logs: $logs/)"
  ((dry_run)) && status_build="not run (dry run)"
else
  tail -n 30 "$logs/build.log" "$logs/configure.log" 2>/dev/null >&2 || true
  status_build="FAILED after $((SECONDS - build_start)) s: see $logs/configure.log and $logs/build.log"
  bench_error="not run: no build"
  finish 1
fi

# ---- [cuda] tests ----------------------------------------------------------------------------------
if ((skip_tests)); then
  status_tests="skipped (--skip-tests)"
else
  echo "+ $python scripts/lib/gpu_bench.py cuda-tests --build $build_dir --out $logs/cuda_tests.json" >&2
  if ((dry_run)); then
    status_tests="not run (dry run)"
  else
    tests_start=$SECONDS
    if "$python" scripts/lib/gpu_bench.py cuda-tests --build "$build_dir" --out "$logs/cuda_tests.json" > "$logs/cuda_tests.txt" 2>&1; then
      status_tests="ok: $(head -n 1 "$logs/cuda_tests.txt"), $((SECONDS - tests_start)) s"
    else
      failed=1
      status_tests="FAILED: $(head -n 1 "$logs/cuda_tests.txt") (details: $logs/cuda_tests.txt, $build_dir/tests/*.cuda-tests.xml)"
    fi
    sed -n '2,$p' "$logs/cuda_tests.txt" >&2
  fi
fi

# ---- benchmark -------------------------------------------------------------------------------------
if ((skip_bench)); then
  bench_error="skipped (--skip-bench)"
else
  data="$logs/data"
  echo "+ $python scripts/lib/gpu_bench.py shard $data --tokens 2097152 --vocab 50257" >&2
  bench_cmd=("$python" scripts/lib/gpu_bench.py bench --binary "$build_dir/src/llmtrain" --config configs/gpt2-124m.json
             --data "$data" --device cuda --gpu-name "${gpu_name:-unknown}" --batches "$batches" --steps "$steps"
             --workdir "$logs" --out "$logs/bench.json" ${precision:+--precision "$precision"})
  echo "+ ${bench_cmd[*]}" >&2
  if ((dry_run)); then
    bench_error="not run (dry run)"
  else
    "$python" scripts/lib/gpu_bench.py shard "$data" --tokens 2097152 --vocab 50257 >/dev/null
    if [[ -n "$gpu_memory_mib" ]]; then  # for reference: what llmtrain's planner expects to fit
      "$build_dir/src/llmtrain" plan --config configs/gpt2-124m.json --device-memory "${gpu_memory_mib}MiB" \
        > "$logs/plan.txt" 2>&1 || true
    fi
    bench_json="$logs/bench.json"
    "${bench_cmd[@]}" || failed=1
  fi
fi
[[ -n "$bench_error" && "$bench_error" != skipped* ]] && ((!dry_run)) && failed=1
finish "$failed"
