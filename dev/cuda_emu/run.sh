#!/usr/bin/env bash
# Builds the CUDA emulation (dev/cuda_emu: the project's kernels, rewritten, on the CPU, with
# AddressSanitizer and UBSan) into build-emu/ and runs every [cuda] test case of test_cuda_ops,
# test_ops, test_cuda_model, test_cublaslt_emu, test_nccl_emu and test_context_ring_emu under it, one process per test case (a sanitizer abort or a
# device fault ends only that case), and those of test_cuda_tensor_parallel and
# test_cuda_context_parallel and test_cuda_expert_parallel under mpirun at 2 and 4 ranks (one process per tensor, context or expert
# rank), printing one line per case and a summary.
#
#   dev/cuda_emu/run.sh [options] [REGEX]     REGEX: run only the cases whose name matches (grep -E)
#     --no-build            run what is built
#     --jobs N              build jobs (default 2)
#     --workers N           OS threads running blocks (LLMTRAIN_EMU_WORKERS, default 2)
#     --schedule ORDER      forward (default), reverse or random thread and block order
#     --timeout SECONDS     per test case (default 3600)
#     --sanitizer NAME      address (default: ASan + UBSan, in build-emu/) or thread (TSan + UBSan:
#                           races between CUDA threads, in build-emu-tsan/; several times slower)
#     --build-dir DIR       default build-emu/ (build-emu-tsan/ with --sanitizer thread)
#     --list                list the cases and exit
#     --selftest            instead of the tests: the emulator's self-test (one deliberate bug per
#                           scenario, selftest/selftest.cu), each outcome checked against the expected one
# Exit status: 0 when every case passed, 1 otherwise. Logs: BUILD_DIR/logs/<binary>/<case>.log.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build_dir=""
sanitizer=address
jobs=2
workers=2
schedule=forward
timeout_s=3600
do_build=1
list_only=0
selftest=0
filter=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-build) do_build=0 ;;
    --jobs) jobs=$2; shift ;;
    --workers) workers=$2; shift ;;
    --schedule) schedule=$2; shift ;;
    --timeout) timeout_s=$2; shift ;;
    --build-dir) build_dir=$2; shift ;;
    --sanitizer) sanitizer=$2; shift ;;
    --list) list_only=1 ;;
    --selftest) selftest=1 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) filter=$1 ;;
  esac
  shift
done
case "$schedule" in forward|reverse|random) ;; *) echo "run.sh: --schedule forward|reverse|random" >&2; exit 2 ;; esac
case "$sanitizer" in
  address) build_dir=${build_dir:-$root/build-emu} ;;
  thread) build_dir=${build_dir:-$root/build-emu-tsan} ;;
  *) echo "run.sh: --sanitizer address|thread" >&2; exit 2 ;;
esac

if [[ $do_build -eq 1 ]]; then
  echo "== building into $build_dir (-j$jobs)"
  mkdir -p "$build_dir"
  cmake -S "$root/dev/cuda_emu" -B "$build_dir" -DCMAKE_BUILD_TYPE=Debug -DLLMTRAIN_EMU_SANITIZER="$sanitizer" \
    >"$build_dir/configure.log" 2>&1 ||
    { cat "$build_dir/configure.log"; exit 1; }
  if ! cmake --build "$build_dir" -j "$jobs" >"$build_dir/build.log" 2>&1; then
    grep -E "error|Error" "$build_dir/build.log" | head -30
    echo "build failed: $build_dir/build.log"
    exit 1
  fi
fi

export LLMTRAIN_EMU_WORKERS=$workers LLMTRAIN_EMU_SCHEDULE=$schedule
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
if [[ $sanitizer == thread ]]; then
  # The CPU reference's OpenMP and OpenBLAS threads synchronise in uninstrumented code: one each.
  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=0:report_signal_unsafe=0:history_size=4}
fi

if [[ $selftest -eq 1 ]]; then
  # scenario[@schedule] and what must come of it: DETECTED or OK (the program's verdict), ASAN
  # (an AddressSanitizer report), UBSAN (an UndefinedBehaviorSanitizer report), TSAN (a
  # ThreadSanitizer race report).
  expectations="race_missing_syncthreads=DETECTED correct_syncthreads=OK race_hidden_by_order@forward=OK
    race_hidden_by_order@reverse=DETECTED race_hidden_by_order@random=DETECTED correct_warp_collectives=OK
    correct_warp_collectives@reverse=OK shuffle_after_exit=DETECTED deadlock=DETECTED mismatched_masks=DETECTED
    partial_warp_full_mask=DETECTED shared_overflow=ASAN global_overflow=ASAN misaligned_float4=UBSAN
    launch_bounds=DETECTED dynamic_shared_without_optin=DETECTED dynamic_shared_with_optin=OK
    block_too_large=DETECTED host_pointer_argument=DETECTED memcpy_wrong_direction=DETECTED
    uninitialised_device_memory=DETECTED trap=DETECTED cublaslt_misaligned_pointer=DETECTED cublaslt_gemm=OK
    reduce_missing_barrier=OK reduce_missing_barrier@random=OK
    tensor_core_product=OK tensor_core_product@reverse=OK ldmatrix_misaligned=DETECTED matrix_divergent=DETECTED"
    # (reduce_missing_barrier: hidden from any sequential order)
  if [[ $sanitizer == thread ]]; then  # TSan: races are reported whatever the order; no ASan
    expectations="race_missing_syncthreads=TSAN correct_syncthreads=OK race_hidden_by_order@forward=TSAN
      race_between_blocks=TSAN disjoint_blocks=OK reduce_missing_barrier=TSAN correct_warp_collectives=OK
      correct_warp_collectives@reverse=OK
      shuffle_after_exit=DETECTED deadlock=DETECTED mismatched_masks=DETECTED misaligned_float4=UBSAN
      launch_bounds=DETECTED dynamic_shared_with_optin=OK host_pointer_argument=DETECTED trap=DETECTED
      cublaslt_gemm=OK tensor_core_product=OK"
  else
    expectations="$expectations race_between_blocks=OK disjoint_blocks=OK"
  fi
  bad=0
  for e in $expectations; do
    scenario=${e%%=*} want=${e#*=} order=forward
    [[ $scenario == *@* ]] && order=${scenario#*@} scenario=${scenario%@*}
    out=$(LLMTRAIN_EMU_SCHEDULE=$order LLMTRAIN_EMU_WORKERS=1 "$build_dir/emu_selftest" "$scenario" 2>&1) || true
    got=OK
    if grep -q "ERROR: AddressSanitizer" <<<"$out"; then got=ASAN
    elif grep -q "WARNING: ThreadSanitizer" <<<"$out"; then got=TSAN
    elif grep -q "runtime error:" <<<"$out"; then got=UBSAN
    elif grep -q "^DETECTED:" <<<"$out"; then got=DETECTED
    elif ! grep -q "^OK:" <<<"$out"; then got="no verdict"
    fi
    verdict=$(grep -E "^(DETECTED|OK):|llmtrain_emu: |SUMMARY: (Address|Thread)Sanitizer|runtime error:" <<<"$out" | head -1 | cut -c1-150)
    if [[ $got == "$want" ]]; then
      printf 'ok    %-44s %-8s %s\n' "$scenario@$order" "$got" "$verdict"
    else
      printf 'WRONG %-44s %s, expected %s\n%s\n' "$scenario@$order" "$got" "$want" "$out"
      bad=$((bad + 1))
    fi
  done
  echo "== self-test: $bad unexpected outcomes"
  [[ $bad -eq 0 ]]
  exit
fi

# Catch2 reads ',' '[' ']' and '\' in a test name as syntax: escape them.
escape_name() { sed -e 's/[],[\\]/\\&/g' <<<"$1"; }

passed=0 failed=0 skipped=0
failures=()
start_all=$(date +%s)
# BINARY or BINARY:RANKS, the latter's cases launched by mpirun as RANKS processes (one tensor
# rank and one emulated device each), reported as "BINARY -np RANKS".
for entry in test_cuda_ops test_ops test_cuda_model test_cublaslt_emu test_nccl_emu test_context_ring_emu \
             test_cuda_tensor_parallel:2 test_cuda_tensor_parallel:4 test_cuda_context_parallel:2 \
             test_cuda_context_parallel:4 test_cuda_expert_parallel:2 test_cuda_expert_parallel:4; do
  bin=${entry%%:*} label=$bin logs=$bin launch=()
  if [[ $entry == *:* ]]; then
    ranks=${entry#*:}
    label="$bin -np $ranks" logs="$bin-np$ranks"
    launch=(env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np "$ranks")
  fi
  exe="$build_dir/$bin"
  [[ -x $exe ]] || { echo "missing $exe"; failed=$((failed + 1)); failures+=("$label: not built"); continue; }
  mapfile -t cases < <("$exe" --list-test-names-only "[cuda]" | sed '/^$/d')
  mkdir -p "$build_dir/logs/$logs"
  for name in "${cases[@]}"; do
    if [[ -n $filter ]] && ! grep -Eq -- "$filter" <<<"$name"; then continue; fi
    if [[ $list_only -eq 1 ]]; then echo "$label: $name"; continue; fi
    log="$build_dir/logs/$logs/$(tr -c 'A-Za-z0-9_.=-' '_' <<<"$name").log"
    t0=$(date +%s.%N)
    set +e
    timeout "$timeout_s" "${launch[@]}" "$exe" "$(escape_name "$name")" >"$log" 2>&1
    rc=$?
    set -e
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    status=PASS
    if [[ $rc -eq 124 ]]; then
      status=TIMEOUT
    elif grep -q "SKIPPED:" "$log"; then
      status=SKIP
    elif grep -q "No test cases matched" "$log"; then
      status=FAIL
    elif [[ $rc -ne 0 ]] || grep -q -e "runtime error:" -e "WARNING: ThreadSanitizer" "$log"; then
      status=FAIL
    fi
    case $status in
      PASS) passed=$((passed + 1)) ;;
      SKIP) skipped=$((skipped + 1)) ;;
      *) failed=$((failed + 1)); failures+=("$label: $name  ($log)") ;;
    esac
    printf '%-7s %7ss  %s: %s\n' "$status" "$secs" "$label" "$name"
    if [[ $status == FAIL || $status == TIMEOUT ]]; then
      grep -E "llmtrain_emu:|ERROR: AddressSanitizer|WARNING: ThreadSanitizer|runtime error:|FAILED:|with expansion|REQUIRE|CHECK|SUMMARY" "$log" |
        head -12 | sed 's/^/          | /'
    fi
  done
done
[[ $list_only -eq 1 ]] && exit 0
echo "== $passed passed, $failed failed, $skipped skipped in $(( $(date +%s) - start_all )) s" \
     "(schedule $schedule, $workers workers, $sanitizer sanitizer)"
for f in "${failures[@]+"${failures[@]}"}"; do echo "   FAILED $f"; done
[[ $failed -eq 0 ]]
