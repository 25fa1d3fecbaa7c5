#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU, offline, with nothing but a C++ compiler, python3
# and the CUDA pieces, from the system or as Python wheels: builds llmtrain for this GPU only,
# runs every Catch2 test case tagged [cuda], trains GPT-2 124M (T=1024, the largest micro-batch
# that fits) with each attention path (our flash attention, cuDNN's), trains the same model in
# PyTorch (bf16 autocast, SDPA, fused AdamW, torch.compile) in the same run, and prints one table:
# tokens/s, MFU, peak GPU memory, the ratio to PyTorch, and the top kernels (nsys where it works,
# else llmtrain's --profile-ops). The table also goes to --out as JSON, with a log of whatever
# failed beside it (FILE.failures.log). After the training runs, bench/bench_kernels times every op of
# the step at GPT-2 124M's shapes (micro-batch 8) against the GPU's ceilings (memory bandwidth,
# bf16 matrix peak), our attention beside cuDNN's; its table is printed below the training table.
#
# Where things are looked for (first found wins; every missing piece is listed at once, one line each):
#   nvcc     $CUDA_HOME/bin, /usr/local/cuda/bin, the PATH, the wheels (nvidia/cu13/bin, nvidia/cuda_nvcc/bin)
#   CUDA     beside nvcc (lib64, targets/*/lib, lib), the wheels nvidia.cuda_runtime and nvidia.cublas
#   NCCL     $NCCL_HOME, beside nvcc, /usr and /usr/local, the wheel nvidia.nccl
#   cuDNN    $CUDNN_HOME, beside nvcc, /usr and /usr/local, the wheel nvidia.cudnn (optional: without
#            it the cudnn row is skipped)
#   wheels   asked of $PYTHON: where the packages nvidia.cu13, nvidia.nccl, nvidia.cudnn... live
#   headers  nlohmann/json, CLI11, Catch2 v2: the system's, else third_party/ (scripts/vendor_deps.sh,
#            run where the packages are and carried along); the network is never used
# Wheels ship libraries under versioned names only (libnccl.so.2, libcudnn.so.9, libcudart.so.13):
# they are passed to CMake by full path, and their folders go on LD_LIBRARY_PATH for the runs.
# Without mpicxx the build has no MPI (one GPU needs none); without OpenBLAS the CPU matmul is slow
# (unused here). Only this GPU's architecture is compiled (90 where there is no GPU), with one job
# per core. The whole run keeps to --budget seconds: a stage that would overrun is skipped, and
# the table says so.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--build-only] [--out FILE] [--budget SECONDS]
#          [--build-dir DIR] [--steps N] [--precision bf16|fp32] [--batches 64,32,16,8,4,2,1]
#          [--attention flash,cudnn] [--skip-tests] [--skip-bench] [--skip-pytorch] [--skip-kernels]
#   --dry-run     find everything, list what is missing, print the commands; needs no GPU
#   --build-only  find, configure and build (no GPU needed), then stop
#   --out FILE    the table as JSON (default BUILD_DIR/gpu_check/gpu_check.json)
#   --budget S    the time the whole check may take (default 480: 8 minutes; the kernel table is
#                 kept 60 s of it)
# Environment: JOBS (default: nproc), CUDA_ARCHS (default: the GPU's compute capability),
#   PEAK_TFLOPS (a GPU this script does not know), CUDA_HOME, NCCL_HOME, CUDNN_HOME,
#   LLMTRAIN_VENDOR_DIR (default: third_party/), PYTHON (default: python3), EXTRA_CMAKE_ARGS
#   (more -D flags for the configure step, split on spaces; they come last and win).
# Exit status: 0 when the build, every [cuda] test and every benchmark row passed; 1 otherwise; 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

dry_run=0 build_only=0 skip_tests=0 skip_bench=0 skip_pytorch=0 skip_kernels=0
build_dir=build-gpu steps=30 precision=bf16 batches="64,32,16,8,4,2,1" attention="flash,cudnn" budget=480 out=""
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --build-only) build_only=1 ;;
    --skip-tests) skip_tests=1 ;;
    --skip-bench) skip_bench=1 ;;
    --skip-pytorch) skip_pytorch=1 ;;
    --skip-kernels) skip_kernels=1 ;;
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
[[ "$steps" =~ ^[0-9]+$ && "$steps" -ge 5 ]] || { echo "gpu_check.sh: --steps: expected a number >= 5" >&2; exit 2; }
[[ "$precision" == bf16 || "$precision" == fp32 ]] || { echo "gpu_check.sh: --precision: bf16 or fp32" >&2; exit 2; }
[[ "$batches" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "gpu_check.sh: --batches: expected numbers separated by commas" >&2; exit 2; }
[[ "$attention" =~ ^(flash|cudnn)(,(flash|cudnn))*$ ]] || { echo "gpu_check.sh: --attention: flash, cudnn or both" >&2; exit 2; }
[[ "$budget" =~ ^[0-9]+$ && "$budget" -ge 60 ]] || { echo "gpu_check.sh: --budget: expected seconds >= 60" >&2; exit 2; }

start=$SECONDS
deadline=$(($(date +%s) + budget))
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
logs="$build_dir/gpu_check"
out="${out:-$logs/gpu_check.json}"
problems=()    # what stops the check: one line each
notes=()       # what is missing but only shrinks the table
found=()       # where each piece was found (printed by --dry-run and in the JSON)
status_build="not run" status_tests="not run" bench_error="" status_kernels="not run"

say() { echo "gpu_check: $*" >&2; }
elapsed() { local s=$((SECONDS - start)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
left() { echo $((deadline - $(date +%s))); }
# show_and_run LOG CMD...: prints the command; runs it (output to LOG) unless this is a dry run.
show_and_run() {
  local log="$1"; shift
  echo "+ $*" >&2
  ((dry_run)) && return 0
  "$@" > "$log" 2>&1
}
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
for name in ("cu13", "cuda_nvcc", "cuda_runtime", "cublas", "nccl", "cudnn"):
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
  for d in "$cuda_root/lib64" "$cuda_root"/targets/*-linux/lib "$cuda_root/lib" "$(w cuda_runtime /lib)" "$(w cublas /lib)"; do
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
  # nvcc links the static CUDA runtime from lib64 beside it; a wheel has lib/ only.
  if [[ ! -d "$cuda_root/lib64" ]] && static="$(compgen -G "$cuda_root/lib/libcudart_static.a" || compgen -G "$(w cuda_runtime /lib)/libcudart_static.a")"; then
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
((have_python && !have_torch && !skip_pytorch)) && notes+=("PyTorch not importable by $python: no PyTorch row")
((have_torch)) || skip_pytorch=1

# The built binaries find the wheels' libraries through this.
if ((${#run_libs[@]})); then
  LD_LIBRARY_PATH="$(printf '%s\n' "${run_libs[@]}" | awk '!seen[$0]++' | paste -sd: -)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi

gpus_text="no GPU"
((gpu_count)) && gpus_text="$gpu_name x$gpu_count"
header="GPU check: $gpus_text (sm $archs, ${gpu_memory_mib:-?} MiB, driver ${driver:-?}), nvcc ${nvcc_version}, MPI $mpi, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"

for f in "${found[@]}"; do say "found: $f"; done
for n in "${notes[@]}"; do say "note: $n"; done
for p in "${problems[@]}"; do say "missing: $p"; done
((${#problems[@]})) || say "nothing missing"
((${#problems[@]} == 0)) && ((dry_run)) && [[ -n "${LD_LIBRARY_PATH:-}" ]] && say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# ---- the table and the JSON ---------------------------------------------------------------------
tests_json="" suite_json="" kernels_json=""
finish() {  # finish EXIT_CODE: the table, the JSON, the failure log; then exit
  local args=(--header "$header, $(elapsed)" --build "$status_build" --tests "$status_tests")
  [[ -n "$tests_json" && -f "$tests_json" ]] && args+=(--tests-json "$tests_json")
  [[ -n "$suite_json" && -f "$suite_json" ]] && args+=(--suite "$suite_json")
  [[ -n "$bench_error" ]] && args+=(--bench-error "$bench_error")
  args+=(--kernels-status "$status_kernels")
  [[ -n "$kernels_json" && -f "$kernels_json" ]] && args+=(--kernels "$kernels_json")
  for p in "${problems[@]}"; do args+=(--problem "$p"); done
  for n in "${notes[@]}"; do args+=(--note "$n"); done
  for f in "${found[@]}"; do args+=(--found "$f"); done
  if ((!dry_run)); then
    mkdir -p "$(dirname "$out")"
    args+=(--json "$out" --failures-log "${out%.json}.failures.log" --logs "$logs" --ld-library-path "${LD_LIBRARY_PATH:-}")
  fi
  if ((have_python)); then
    "$python" scripts/lib/gpu_bench.py report "${args[@]}" || true
  fi
  ((dry_run)) || say "table: $out; failures: ${out%.json}.failures.log"
  exit "$1"
}
failed=0

if ((${#problems[@]})); then
  if ((!dry_run)); then
    status_build="not run: ${#problems[@]} missing piece(s), listed above"
    bench_error="not run: no build" status_kernels="not run: no build"
    finish 1
  fi
  say "dry run: continuing to show what would run"
  failed=1
fi
((dry_run)) || mkdir -p "$logs"

# ---- build ---------------------------------------------------------------------------------------
# Only llmtrain and the test binaries that hold [cuda] cases.
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
  targets+=("${test_targets[@]}")
fi
build_start=$SECONDS
if show_and_run "$logs/configure.log" cmake -S . -B "$build_dir" "${generator[@]}" "${cmake_flags[@]}" &&
   show_and_run "$logs/build.log" cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"; then
  status_build="ok: sm $archs, -j$jobs, $((SECONDS - build_start)) s, targets ${targets[*]}"
  ((dry_run)) && status_build="not run (dry run)"
else
  tail -n 30 "$logs/configure.log" "$logs/build.log" 2>/dev/null >&2 || true
  status_build="FAILED after $((SECONDS - build_start)) s: see $logs/configure.log and $logs/build.log"
  bench_error="not run: no build" status_kernels="not run: no build"
  finish 1
fi
if ((build_only)); then
  status_tests="not run (--build-only)" bench_error="not run (--build-only)" status_kernels="not run (--build-only)"
  finish 0
fi

# ---- [cuda] tests (at most a quarter of the time left) ---------------------------------------------
if ((skip_tests)); then
  status_tests="skipped (--skip-tests)"
else
  tests_timeout=$(( $(left) / 4 ))
  ((tests_timeout < 60)) && tests_timeout=60
  echo "+ $python scripts/lib/gpu_bench.py cuda-tests --build $build_dir --timeout $tests_timeout --out $logs/cuda_tests.json" >&2
  if ((dry_run)); then
    status_tests="not run (dry run)"
  else
    tests_start=$SECONDS
    tests_json="$logs/cuda_tests.json"
    if "$python" scripts/lib/gpu_bench.py cuda-tests --build "$build_dir" --timeout "$tests_timeout" --out "$tests_json" \
         > "$logs/cuda_tests.txt" 2>&1; then
      status_tests="ok: $(head -n 1 "$logs/cuda_tests.txt"), $((SECONDS - tests_start)) s"
    else
      failed=1
      status_tests="FAILED: $(head -n 1 "$logs/cuda_tests.txt") (details: $logs/cuda_tests.txt, $build_dir/tests/*.cuda-tests.xml)"
    fi
    sed -n '2,$p' "$logs/cuda_tests.txt" >&2
  fi
fi

# ---- benchmark: llmtrain with each attention path, then PyTorch on the same shapes -----------------
# The training runs stop 60 s early when the kernel table comes after them.
kernels_reserve=10
((skip_kernels)) || kernels_reserve=60
if ((skip_bench)); then
  bench_error="skipped (--skip-bench)"
else
  data="$logs/data"
  echo "+ $python scripts/lib/gpu_bench.py shard $data --tokens 2097152 --vocab 50257" >&2
  suite_cmd=("$python" scripts/lib/gpu_bench.py suite --binary "$build_dir/src/llmtrain" --config configs/gpt2-124m.json
             --data "$data" --gpu-name "${gpu_name:-unknown}" --batches "$batches" --steps "$steps"
             --precision "$precision" --attention "$attention" --deadline "$((deadline - kernels_reserve))"
             --workdir "$logs" --out "$logs/suite.json")
  ((skip_pytorch)) || suite_cmd+=(--pytorch "$python")
  echo "+ ${suite_cmd[*]}" >&2
  if ((dry_run)); then
    bench_error="not run (dry run)"
  else
    "$python" scripts/lib/gpu_bench.py shard "$data" --tokens 2097152 --vocab 50257 >/dev/null
    suite_json="$logs/suite.json"
    "${suite_cmd[@]}" || failed=1
  fi
fi

# ---- every kernel against its ceiling (bench/bench_kernels), beside the training table -------------
if ((skip_kernels)); then
  status_kernels="skipped (--skip-kernels)"
else
  kernels_cmd=("$build_dir/bench/bench_kernels" --batch 8 --json "$logs/kernels.json")
  echo "+ ${kernels_cmd[*]}" >&2
  if ((dry_run)); then
    status_kernels="not run (dry run)"
  elif (($(left) < 20)); then
    status_kernels="skipped: the budget is spent ($(left) s left)"
  else
    kernels_start=$SECONDS
    kernels_json="$logs/kernels.json"
    rm -f "$kernels_json"
    if timeout "$(($(left) - 5))" "${kernels_cmd[@]}" > "$logs/kernels.txt" 2>&1; then
      status_kernels="ok: $(($(grep -c . "$logs/kernels.txt") - 2)) ops, $((SECONDS - kernels_start)) s (details: $logs/kernels.txt)"
    else
      failed=1
      status_kernels="FAILED (exit $?) after $((SECONDS - kernels_start)) s: $(tail -n 1 "$logs/kernels.txt") (details: $logs/kernels.txt)"
    fi
  fi
fi
finish "$failed"
