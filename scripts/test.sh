#!/usr/bin/env bash
# Installs the dependencies, builds llmtrain and runs every test, showing all output.
# Two configurations: the default one (CUDA compiled wherever nvcc is found) in build/, and a
# CPU-only one in build-cpu/, which must build and pass on its own; then tests/container_test.sh.
# Environment: JOBS (parallel build jobs, default: CPU count), CI=true (warnings are errors).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

jobs="${JOBS:-$(nproc)}"
werror=OFF
[[ "${CI:-}" == "true" ]] && werror=ON

run_configuration() {
  local dir="$1"; shift
  echo "=== configure $dir: $*"
  # Testing is switched on explicitly: a folder configured before without tests (by hand, say)
  # must not leave ctest with nothing to run.
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=ON -DLLMTRAIN_WERROR="$werror" "$@"
  echo "=== build $dir"
  cmake --build "$dir" -j "$jobs"
  echo "=== test $dir"
  (cd "$dir" && OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ctest --output-on-failure --no-tests=error -j "$jobs")
}

run_configuration build
run_configuration build-cpu -DLLMTRAIN_CUDA=OFF
# The CPU image built and run with podman: one container, two nodes, a node lost, a network cut
# (about 10 minutes). Where podman cannot run as root it prints "SKIPPED: why" and exits 77: the
# tests still pass, and the last line says the container test was skipped, not that it passed.
echo "=== container test"
container_log=$(mktemp)
trap 'rm -f "$container_log"' EXIT
container_status=0
bash tests/container_test.sh . 2>&1 | tee "$container_log" || container_status=$?
if ((container_status == 77)); then
  reason=$(grep -m 1 '^SKIPPED: ' "$container_log" | sed 's/^SKIPPED: //')
  echo "=== container test SKIPPED (${reason:-no reason given})"
  echo "=== all tests passed in build/ and build-cpu/; the container test skipped (${reason:-no reason given})"
elif ((container_status != 0)); then
  echo "=== container test FAILED (exit $container_status)"
  exit "$container_status"
else
  echo "=== all tests passed in build/ and build-cpu/, and the container test"
fi
