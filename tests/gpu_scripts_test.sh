#!/usr/bin/env bash
# The GPU node scripts as far as a machine without a GPU takes them: shell syntax (and shellcheck
# where installed), scripts/gpu_check.sh --dry-run (with and without its kernel table), the
# report's self-test, the [cuda] test runner
# on this build's test binaries, the benchmark helper on the CPU (a tiny config: the path that
# measures) and with --device cuda where there is no GPU (the failure reported, not hidden),
# vendor_deps.sh from the installed packages, and bench_vs_pytorch.py --device cpu --tiny where
# PyTorch is installed.
# Usage: gpu_scripts_test.sh LLMTRAIN BUILD_DIR SOURCE_DIR
set -uo pipefail
llmtrain="$1" build="$2"
cd "$3" || exit 1
python=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; failed=$((failed + 1)); }
check() { local what="$1"; shift; if "$@" > "$tmp/out" 2>&1; then ok "$what"; else bad "$what"; cat "$tmp/out"; fi; }

check "bash -n gpu_check.sh vendor_deps.sh gpu_bare_node_test.sh" bash -n scripts/gpu_check.sh scripts/vendor_deps.sh tests/gpu_bare_node_test.sh
if command -v shellcheck >/dev/null; then
  check "shellcheck" shellcheck scripts/gpu_check.sh scripts/vendor_deps.sh
fi
check "gpu_bench.py self-test" "$python" scripts/lib/gpu_bench.py self-test

if PYTHON="$python" scripts/gpu_check.sh --dry-run --full --build-dir "$tmp/build-gpu" > "$tmp/dry" 2>&1 && grep -q "benchmark *| not run (dry run)" "$tmp/dry" && grep -q "^+ cmake -S . -B" "$tmp/dry"; then
  ok "gpu_check.sh --dry-run"
else
  bad "gpu_check.sh --dry-run"; cat "$tmp/dry"
fi
# No mode named: the default budget (480 s) cannot hold the full mode's needs and a build, so --quick.
if PYTHON="$python" scripts/gpu_check.sh --dry-run --build-dir "$tmp/build-gpu" > "$tmp/dry0" 2>&1 &&
   grep -q "^GPU check (quick, budget 480 s)" "$tmp/dry0" && grep -q "^gpu_check: the quick mode (default for --budget 480" "$tmp/dry0" &&
   grep -q "^gpu_check: status: dry run, nothing run" "$tmp/dry0"; then
  ok "gpu_check.sh --dry-run: the default budget's mode is --quick"
else
  bad "gpu_check.sh --dry-run: the default mode"; cat "$tmp/dry0"
fi
# The kernel table: built (bench_kernels among the targets), run after the training runs, its
# status line in the table; --skip-kernels leaves it out of both.
if grep -q "^+ cmake --build .* --target llmtrain bench_kernels" "$tmp/dry" &&
   grep -q "^+ $tmp/build-gpu/bench/bench_kernels --batch 8 --json $tmp/build-gpu/gpu_check/kernels.json" "$tmp/dry" &&
   grep -q "^ kernels | not run (dry run)" "$tmp/dry" &&
   [[ $(grep -n "bench_kernels --batch" "$tmp/dry" | cut -d: -f1) -gt $(grep -n "gpu_bench.py suite" "$tmp/dry" | cut -d: -f1) ]]; then
  ok "gpu_check.sh --dry-run: the kernel table after the training benchmark"
else
  bad "gpu_check.sh --dry-run: the kernel table"; cat "$tmp/dry"
fi
if PYTHON="$python" scripts/gpu_check.sh --dry-run --full --skip-kernels --build-dir "$tmp/build-gpu" > "$tmp/dry2" 2>&1;
   grep -q "^ kernels | skipped (--skip-kernels)" "$tmp/dry2" && ! grep -q "bench_kernels" "$tmp/dry2"; then
  ok "gpu_check.sh --dry-run --skip-kernels"
else
  bad "gpu_check.sh --dry-run --skip-kernels"; cat "$tmp/dry2"
fi

if [[ -f /usr/include/nlohmann/json.hpp && -f /usr/include/CLI/CLI.hpp && -f /usr/include/catch2/catch.hpp ]]; then
  scripts/vendor_deps.sh "$tmp/vendor" > "$tmp/vendor.log" 2>&1
  if [[ $? -eq 0 && -f "$tmp/vendor/include/nlohmann/json.hpp" && -f "$tmp/vendor/include/CLI/CLI.hpp" &&
        -f "$tmp/vendor/include/catch2/catch.hpp" ]] && grep -q "^Catch2 .*sha256 [0-9a-f]\{64\}$" "$tmp/vendor/SOURCES.txt"; then
    ok "vendor_deps.sh from the installed packages"
  else
    bad "vendor_deps.sh"; cat "$tmp/vendor.log"
  fi
else
  echo "note: the header packages are not installed: vendor_deps.sh not checked"
fi

# [cuda] cases of every test binary: without a GPU each skips, visibly; none may fail. Without
# --allow-all-skipped, every case skipping is itself a failure (what a GPU node must not pass with).
if "$python" scripts/lib/gpu_bench.py cuda-tests --build "$build" --allow-all-skipped --out "$tmp/cuda_tests.json" \
     > "$tmp/cuda_tests" 2>&1 &&
   grep -qE "^[0-9]+ passed, 0 failed, [0-9]+ skipped" "$tmp/cuda_tests"; then
  ok "cuda-tests: $(head -n 1 "$tmp/cuda_tests")"
else
  bad "cuda-tests"; cat "$tmp/cuda_tests"
fi
if [[ $(grep -cE "^[0-9]+ passed" "$tmp/cuda_tests") == 1 ]] && grep -qE "^0 passed, 0 failed, [1-9]" "$tmp/cuda_tests"; then
  if ! "$python" scripts/lib/gpu_bench.py cuda-tests --build "$build" --out "$tmp/cuda_tests2.json" > "$tmp/cuda_tests2" 2>&1 &&
     grep -q "problem every \[cuda\] case skipped" "$tmp/cuda_tests2"; then
    ok "cuda-tests: every case skipped is a failure"
  else
    bad "cuda-tests: every case skipped passed"; cat "$tmp/cuda_tests2"
  fi
fi

# The benchmark helper on the CPU, tiny model: search, timed run, op times, table.
"$python" scripts/lib/gpu_bench.py shard "$tmp/data" --tokens 20000 --vocab 256 > /dev/null
OMP_NUM_THREADS=1 "$python" scripts/lib/gpu_bench.py bench --binary "$llmtrain" --config configs/tiny.json \
  --data "$tmp/data" --device cpu --batches 64,4 --probe-steps 2 --steps 6 --profile-steps 2 --timeout 120 \
  --out "$tmp/cpu.json" > "$tmp/cpu.log" 2>&1
"$python" scripts/lib/gpu_bench.py report --bench "$tmp/cpu.json" --tests n/a --build n/a > "$tmp/cpu_table" 2>&1
if grep -q "^ benchmark .*| ok: GPT-2 [0-9]*K, T=64, fp32, micro-batch 64" "$tmp/cpu_table" &&
   grep -q "^ tokens/s .*| [0-9]" "$tmp/cpu_table" && grep -q "llmtrain --profile-ops" "$tmp/cpu_table" &&
   grep -q "calls  matmul" "$tmp/cpu_table"; then
  ok "benchmark helper on the CPU"
else
  bad "benchmark helper on the CPU"; cat "$tmp/cpu.log" "$tmp/cpu_table" "$tmp/cpu.json"
fi

# Where no GPU runs it, --device cuda fails, and the table says so.
if ! command -v nvidia-smi >/dev/null; then
  "$python" scripts/lib/gpu_bench.py bench --binary "$llmtrain" --config configs/tiny.json --data "$tmp/data" \
    --device cuda --batches 8,4 --probe-steps 2 --steps 6 --timeout 120 --out "$tmp/cuda.json" > "$tmp/cuda.log" 2>&1
  status=$?
  "$python" scripts/lib/gpu_bench.py report --bench "$tmp/cuda.json" > "$tmp/cuda_table" 2>&1
  if [[ $status -eq 1 ]] && grep -qi "^ benchmark .*| FAILED: llmtrain: error: .*cuda" "$tmp/cuda_table" &&
     grep -q "8: failed" "$tmp/cuda_table"; then
    ok "benchmark failure on --device cuda is reported"
  else
    bad "benchmark failure on --device cuda (exit $status)"; cat "$tmp/cuda.log" "$tmp/cuda_table"
  fi
fi

if "$python" -c "import torch" 2>/dev/null; then
  if OMP_NUM_THREADS=1 "$python" scripts/bench_vs_pytorch.py --device cpu --tiny --threads 1 --llmtrain "$llmtrain" \
       > "$tmp/vs" 2>&1 && grep -q "^pytorch : .*tokens/s" "$tmp/vs" && grep -q "^llmtrain: .*tokens/s" "$tmp/vs" &&
     grep -q "^ratio   : .*x" "$tmp/vs"; then
    ok "bench_vs_pytorch.py --device cpu --tiny"
  else
    bad "bench_vs_pytorch.py --device cpu --tiny"; cat "$tmp/vs"
  fi
else
  echo "note: no PyTorch for $python: bench_vs_pytorch.py not run (scripts/setup.sh --with-torch)"
fi

echo "$passed passed, $failed failed"
((failed == 0))
