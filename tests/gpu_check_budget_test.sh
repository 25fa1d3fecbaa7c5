#!/usr/bin/env bash
# scripts/gpu_check.sh keeps to its --budget, whatever the stages take: here every GPU-side piece
# is a stub (nvcc and its probe, nvidia-smi, cmake and its build, the test binaries, llmtrain,
# bench_kernels, compute-sanitizer), slow enough that the stages cannot all fit. Under
# --budget 240 and --budget 480, in the quick and the full mode, the run must end inside the budget
# and its table must give every stage a status (ran, skipped for time, not run, or failed), and
# its status (the last line, the JSON's "status", the exit code) must be passed (0), failed (1) or
# incomplete (out of time) (3) as the table says; a build slower than its cap must be stopped
# there, with a row that says so. Test binaries that outrun the tests' share of the budget are
# stopped and skipped for time, not failed, and the run is incomplete, not failed. After a long
# build the [cuda] tests and the benchmark still get their needs; the sanitizer gets what is left.
# The default mode of the default budget is the quick one, and it fits.
# Time is a fake clock that only the stubs move: each run's clock is a file (GPU_CHECK_FAKE_CLOCK)
# that a stub moves on by what it stands for instead of sleeping, and a capped stub stops at the
# deadline gpu_check.sh or gpu_bench.py hands it (GPU_CHECK_FAKE_DEADLINE) with exit status 124, as
# timeout(1) would stop it. So the machine's load cannot change a verdict, and the runs take
# seconds. The clock runs 10 budget seconds to its second (GPU_CHECK_TIME_SCALE), which checks that
# conversion too.
# Usage: gpu_check_budget_test.sh SOURCE_DIR
set -uo pipefail
cd "$1" || exit 1
scale=10
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fake="$tmp/fake"
mkdir -p "$fake/bin" "$fake/cuda/bin" "$fake/cuda/include/cccl/nv" "$fake/cuda/lib64" "$fake/stubs"
for f in cublasLt.h nccl.h cudnn.h cccl/nv/target; do : > "$fake/cuda/include/$f"; done
for f in libcudart.so libcublas.so libcublasLt.so libnccl.so libcudnn.so libnvrtc.so libcudart_static.a; do
  : > "$fake/cuda/lib64/$f"
done
stub() {  # stub PATH BODY: an executable bash script
  printf '#!/usr/bin/env bash\n%s\n' "$2" > "$1"
  chmod +x "$1"
}
clock_start=1700000000000000  # each run's clock starts here (microseconds)
# advance SECONDS, advance --to MICROSECONDS: the stubs' sleep. The clock moves on, but not past
# GPU_CHECK_FAKE_DEADLINE where the stub was handed one: it stops there, with exit status 124.
advance="$fake/stubs/advance"
stub "$advance" '
clock="${GPU_CHECK_FAKE_CLOCK:?}"
now=$(<"$clock")
if [[ "$1" == --to ]]; then end="$2"; else end=$(( now + $(awk -v s="$1" "BEGIN { printf \"%.0f\", s * 1000000 }") )); fi
((end >= now)) || end=$now
code=0
if [[ -n "${GPU_CHECK_FAKE_DEADLINE:-}" ]] && ((end > GPU_CHECK_FAKE_DEADLINE)); then
  end=$(( GPU_CHECK_FAKE_DEADLINE > now ? GPU_CHECK_FAKE_DEADLINE : now )) code=124
fi
echo "$end" > "$clock.$$" && mv -f "$clock.$$" "$clock"
exit "$code"'
# Seconds below are the clock's (times 10 on the check's budget).
stub "$fake/cuda/bin/nvcc" '
if [[ "$1" == --version ]]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
"'"$advance"'" 0.3 || exit 124
while (($#)); do [[ "$1" == -o ]] && out="$2"; shift; done
printf "#!/usr/bin/env bash\necho \"runtime 13000 driver 13000 devices 1 kernel ran\"\n" > "$out"; chmod +x "$out"'
stub "$fake/cuda/bin/compute-sanitizer" '
"'"$advance"'" 3 || exit 124
[[ "$2" == racecheck ]] && echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
echo "========= ERROR SUMMARY: 0 errors"'
stub "$fake/bin/nvidia-smi" '
[[ "$*" == *--query-gpu* ]] && echo "NVIDIA H200, 9.0, 143771, 580.65.06"
exit 0'
stub "$fake/bin/cmake" '
if [[ "$1" == --build ]]; then
  dir="$2"; "'"$advance"'" "${FAKE_BUILD_SECONDS:-2}" || exit 124
  # FAKE_BUILD_UNTIL: the build ends at this time of the clock, however long discovery took before it.
  if [[ -n "${FAKE_BUILD_UNTIL:-}" ]]; then "'"$advance"'" --to "$FAKE_BUILD_UNTIL" || exit 124; fi
  mkdir -p "$dir/src" "$dir/tests" "$dir/bench"
  cp "'"$fake"'/stubs/llmtrain" "$dir/src/llmtrain"; cp "'"$fake"'/stubs/bench_kernels" "$dir/bench/bench_kernels"
  for t in "$@"; do [[ "$t" == test_* ]] && cp "'"$fake"'/stubs/test" "$dir/tests/$t"; done
  exit 0
fi
while (($#)); do [[ "$1" == -B ]] && mkdir -p "$2" && : > "$2/CMakeCache.txt"; shift; done'
stub "$fake/stubs/test" '
while (($#)); do [[ "$1" == --out ]] && out="$2"; shift; done
if [[ -n "${FAKE_TEST_SECONDS:-}" ]]; then  # a slow binary: one case done, one under way, then a long wait
  printf "%s" "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Catch name=\"t\"><Group name=\"t\">
<TestCase name=\"done\" tags=\"[cuda]\"><OverallResult success=\"true\"/></TestCase>
<TestCase name=\"under way\" tags=\"[cuda]\"><Expression success=\"true\"/>" > "$out"
  exec "'"$advance"'" "$FAKE_TEST_SECONDS"
fi
"'"$advance"'" 3 || exit 124
cat > "$out" <<XML
<?xml version="1.0" encoding="UTF-8"?><Catch name="t"><Group name="t">
<TestCase name="a" tags="[cuda]"><OverallResult success="true"/></TestCase>
<TestCase name="b" tags="[cuda]"><OverallResult success="true"/></TestCase>
<TestCase name="c" tags="[cuda]"><Warning>SKIPPED: no cuDNN attention here: cuDNN 9.10.0 is older than 9.16.0</Warning>
<OverallResult success="true"/></TestCase></Group></Catch>
XML'
stub "$fake/stubs/llmtrain" '
profile=0
while (($#)); do
  case "$1" in --config) config="$2" ;; --run-dir) dir="$2" ;; --profile-ops) profile=1 ;; esac; shift
done
"'"$advance"'" 2 || exit 124
if [[ -n "${FAKE_CUDNN_REFUSES:-}" ]] && grep -q "\"attention\": \"cudnn\"" "$config"; then
  echo "llmtrain: error: model.attention: \"cudnn\": cuDNN 9.19.0 refuses B=16 T=1024 C=768 NH=12 NKV=12 (head size 64): no cuDNN engine runs this graph; use \"auto\" or \"flash\"" >&2
  exit 2
fi
mkdir -p "$dir"
steps=$(/usr/bin/python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[\"train\"][\"max_steps\"])" "$config")
for ((s = 1; s <= steps; s++)); do
  echo "{\"step\": $s, \"loss\": 5.0, \"tokens_per_s\": 400000.0, \"peak_memory_bytes\": 42949672960}"
done > "$dir/metrics.jsonl"
((profile)) && echo "  matmul_backward  10 calls  0.500 s  50.0%" >&2
exit 0'
stub "$fake/stubs/bench_kernels" '
while (($#)); do [[ "$1" == --json ]] && out="$2"; shift; done
"'"$advance"'" 2 || exit 124
echo "{\"device\": \"H200\", \"dtype\": \"bf16\", \"shape\": {\"B\": 8}, \"reps\": 1, \"ceilings\": {\"gbps\": 4300, \"tflops\": 790},
  \"rows\": [{\"op\": \"layernorm_forward\", \"shape\": \"N=8192\", \"ms\": 0.01, \"bound\": \"memory\", \"gbps\": 2500, \"fraction\": 0.58}]}" > "$out"
printf "header\nrule\nlayernorm_forward\n"'

# check NAME BUDGET ARGS...: runs gpu_check.sh in the background on its own clock ($tmp/NAME.clock);
# its output in $tmp/NAME.log, its exit status and the budget seconds it took in $tmp/NAME.time.
pids=()
check() {
  local name="$1" budget="$2"; shift 2
  echo "$clock_start" > "$tmp/$name.clock"
  (
    CUDA_HOME="$fake/cuda" PATH="$fake/bin:$PATH" PYTHON=/usr/bin/python3 GPU_CHECK_TIME_SCALE=$scale JOBS=2 \
      GPU_CHECK_FAKE_CLOCK="$tmp/$name.clock" \
      scripts/gpu_check.sh --budget "$budget" --build-dir "$tmp/build-$name" "$@" > "$tmp/$name.log" 2>&1
    echo "exit $? after $(( ($(<"$tmp/$name.clock") - clock_start) * scale / 1000000 )) s" > "$tmp/$name.time"
  ) &
  pids+=($!)
}
check quick240 240
check full480 480 --full
check full240 240 --full
FAKE_CUDNN_REFUSES=1 check quick480 480 --quick  # and cuDNN refuses the benchmark's shape
FAKE_BUILD_SECONDS=60 check slowbuild240 240
FAKE_TEST_SECONDS=30 check outoftime240 240   # test_ops runs 300 s: stopped at the tests' deadline
# A build that ends 120 s into the budget, inside its cap (360 - 10 - 180 s, from the start); it
# leaves 230 s, less than every stage's needs (270 s): the tests' 100 s and the benchmark's 80 s
# come before the sanitizer's.
FAKE_BUILD_SECONDS=0 FAKE_BUILD_UNTIL=$((clock_start + 120 * 1000000 / scale)) check longbuild360 360
check default480 480                          # no mode named, the default budget's: quick, and it fits
wait "${pids[@]}"

passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; failed=$((failed + 1)); cat "$tmp/$2.log"; }
status='(ok|FAILED|skipped|not run|incomplete \(out of time\))'
for run in quick240:240:quick full480:480:full full240:240:full quick480:480:quick slowbuild240:240:quick \
           outoftime240:240:quick longbuild360:360:quick default480:480:quick; do
  IFS=: read -r name budget mode <<< "$run"
  log="$tmp/$name.log"
  read -r _ code _ took _ < "$tmp/$name.time"
  why=()
  ((took <= budget)) || why+=("took $took s of a budget of $budget s")
  # The status: the last line, the JSON's, the exit code, and the table agree.
  last="$(tail -n 1 "$log")"
  json_status="$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["status"])' \
                 "$tmp/build-$name/gpu_check/gpu_check.json" 2>/dev/null)"
  case "$code" in 0) want=passed ;; 1) want=failed ;; 3) want="incomplete (out of time)" ;; *) want="exit $code?" ;; esac
  [[ "$last" == "gpu_check: status: $want"* ]] || why+=("exit $code but the last line is '$last'")
  [[ "$json_status" == "$want" ]] || why+=("exit $code but the JSON's status is '$json_status'")
  if grep -qE "^ [^ ].* \| .*FAILED" "$log"; then
    [[ "$want" == failed ]] || why+=("a row says FAILED, the status $want")
  elif grep -qE "^ (\[cuda\] tests|benchmark|kernels|sanitizer) +\| (skipped for time|incomplete \(out of time\))|^ sanitizer +\| .*stopped at its|^ skipped: |\| not run: out of time" "$log"; then
    [[ "$want" == "incomplete (out of time)" ]] || why+=("a stage ran out of time, the status $want")
  else
    [[ "$want" == passed ]] || why+=("no row failed or ran out of time, the status $want")
  fi
  grep -q "^GPU check ($mode, budget $budget s)" "$log" || why+=("no header naming the $mode mode")
  for row in build '\[cuda\] tests' kernels; do
    grep -qE "^ $row +\| $status" "$log" || why+=("no status for the stage '$row'")
  done
  grep -qE "^ probe +\| compiled and linked .*driver supports CUDA 13.0, 1 device" "$log" || why+=("no row for the probe")
  grep -qE "^ sanitizer +\| (racecheck (ok|stopped)|skipped|not run)" "$log" || why+=("no status for the sanitizer")
  if [[ "$name" == slowbuild* ]]; then
    grep -qE "^ build +\| FAILED: stopped at its cap of [0-9]+ s" "$log" || why+=("the slow build is not reported as stopped at its cap")
    grep -qE "^ benchmark +\| not run: no build" "$log" || why+=("the benchmark not reported as not run")
    ((code == 1)) || why+=("exit $code, not 1")
  else
    grep -qE "^ build +\| ok: " "$log" || why+=("the build did not run")
    # (A binary still running at the tests' deadline is stopped there and skipped for time.)
    grep -qE "^ \[cuda\] tests +\| (ok|FAILED|incomplete \(out of time\)): [0-9]+ passed" "$log" || why+=("the tests did not run")
    grep -qE "^   skipped +\| [0-9]+ cases?: no cuDNN attention here: cuDNN 9.10.0 is older than 9.16.0" "$log" ||
      [[ "$name" == outoftime240 ]] || why+=("the tests' skip reason is not in the table")
    for path in flash cudnn; do
      grep -qE "^ llmtrain, $path attention " "$log" || why+=("no row for $path attention")
    done
    if [[ "$name" == quick480 ]]; then
      grep -qE "^ llmtrain, cudnn attention .*skipped: llmtrain: error: model.attention: \"cudnn\": cuDNN 9.19.0 refuses B=16" "$log" ||
        why+=("cuDNN's refusal is not in the table")
      ((code == 0)) || why+=("cuDNN's refusal failed the check")
    fi
    if [[ "$name" == outoftime240 ]]; then
      # test_ops' finished case counts; it and the binaries after it are skipped for time.
      grep -qE "^ \[cuda\] tests +\| incomplete \(out of time\): 1 passed, 0 failed, 0 skipped .*skipped for time: test_ops \(stopped at its deadline after [0-9]+ s\), test_cuda_ops \(not run\), test_cuda_model \(not run\)" "$log" ||
        why+=("the stopped test binary is not reported as skipped for time")
      grep -q "FAILED" "$log" && why+=("a FAILED in the output: $(grep -m 1 FAILED "$log")")
      ((code == 3)) || why+=("exit $code, not 3")
      [[ "$last" == "gpu_check: status: incomplete (out of time) (skipped or cut short for time: [cuda] tests"* ]] ||
        why+=("the last line does not name the tests as out of time")
    fi
    if [[ "$name" == longbuild360 || "$name" == default480 ]]; then
      # The build took long (longbuild360), yet the tests and the benchmark get at least their needs.
      grep -qE "^ build +\| ok: .*, [0-9]+ s of its cap of [0-9]+ s" "$log" || why+=("the build did not end inside its cap")
      tests_slice="$(sed -nE 's/^ \[cuda\] tests +\| ok: .* s of its ([0-9]+) s$/\1/p' "$log")"
      ((${tests_slice:-0} >= 100)) || why+=("the tests got ${tests_slice:-no} s, less than their need of 100 s")
      bench_slice="$(sed -nE 's/.*gpu_bench.py suite .* --deadline <([0-9]+) s from now>$/\1/p' "$log")"
      ((${bench_slice:-0} >= 80)) || why+=("the benchmark got ${bench_slice:-no} s, less than its need of 80 s")
      grep -qE "^ llmtrain, flash attention +\| +16 \| +400,000" "$log" || why+=("no flash attention row measured")
    fi
    if [[ "$name" == longbuild360 ]]; then
      grep -qE "^ sanitizer +\| (skipped for time|racecheck)" "$log" || why+=("the sanitizer has no status")
    fi
    if [[ "$name" == default480 ]]; then
      ((code == 0)) || why+=("the default mode at the default budget did not pass: exit $code")
      grep -qE "^ sanitizer +\| racecheck ok .*synccheck ok" "$log" || why+=("the sanitizer did not run in full")
    fi
    if [[ "$mode" == quick ]]; then
      grep -qE "^ kernels \| skipped \(--quick\)" "$log" || why+=("the quick mode ran the kernel table")
      grep -q "cuda-tests .*--and-the-rest" "$log" && why+=("the quick mode ran every test binary")
    fi
  fi
  if ((${#why[@]})); then bad "$name ($code, $took s): $(IFS=';'; echo "${why[*]}")" "$name"; else ok "$name: exit $code ($want) after $took s of $budget s"; fi
done
# The build's cap in the full mode keeps the tests' and the benchmark's needs (200 s and 2 x 135 s
# without PyTorch), not less: 1000 - 10 - 470 s, less the few seconds discovery takes.
echo "$clock_start" > "$tmp/dry.clock"
CUDA_HOME="$fake/cuda" PATH="$fake/bin:$PATH" PYTHON=/usr/bin/python3 GPU_CHECK_FAKE_CLOCK="$tmp/dry.clock" \
  scripts/gpu_check.sh --dry-run --full --skip-pytorch --budget 1000 --build-dir "$tmp/build-dry" > "$tmp/dry.log" 2>&1
cap="$(sed -nE 's/^\+ cmake --build .*\(capped at ([0-9]+) s\)$/\1/p' "$tmp/dry.log")"
if ((${cap:-0} >= 500 && ${cap:-0} <= 520)); then
  ok "--full --budget 1000: the build capped at $cap s, 470 s kept for the tests and the benchmark"
else
  bad "--full --budget 1000: the build capped at ${cap:-no} s, not 500-520 s" dry
fi
# What was measured is kept for the next run's split.
if grep -q "^full tests [0-9]" "$tmp/build-full480/gpu_check/stage_seconds.txt" 2>/dev/null ||
   grep -q "^full bench [0-9]" "$tmp/build-full480/gpu_check/stage_seconds.txt" 2>/dev/null; then
  ok "the stages' measured times are kept: $(tr '\n' ' ' < "$tmp/build-full480/gpu_check/stage_seconds.txt")"
else
  bad "no measured stage times kept" full480
fi
echo "$passed passed, $failed failed"
((failed == 0))
