#!/usr/bin/env bash
# The launch files parse (bash -n, a YAML parser), and every `llmtrain SUBCOMMAND --flag` in the
# README's code and in the launch files is a flag that subcommand has.
# Usage: launch_files_test.sh LLMTRAIN SOURCE_DIR
set -uo pipefail
llmtrain="$1"
cd "$2"
failed=0
check() { if "$@"; then echo "ok: ${*: -1}"; else echo "FAILED: $*"; failed=$((failed + 1)); fi; }
check bash -n scripts/launch/mpirun.sh
check bash -n scripts/launch/slurm.sbatch
if /usr/bin/python3 -c "import yaml" 2>/dev/null; then
  check /usr/bin/python3 -c "import sys, yaml; docs = list(yaml.safe_load_all(open(sys.argv[1]))); assert [d['kind'] for d in docs] == ['PersistentVolumeClaim', 'MPIJob']" scripts/launch/k8s-mpijob.yaml
else
  echo "SKIPPED: no YAML parser (python3-yaml) for scripts/launch/k8s-mpijob.yaml"
fi
# Flags after `llmtrain SUB` on one line (README code blocks, launch files) against SUB --help.
lines=$(grep -hoE '(llmtrain|build/src/llmtrain) (train|generate|eval|tokenize|export|plan|inspect|check-config|info)( [^|#;&]*)?' \
          README.md scripts/launch/* scripts/quickstart.sh)
flags_checked=0
while IFS= read -r line; do
  sub=$(awk '{print $2}' <<<"$line")
  help=$("$llmtrain" "$sub" --help 2>&1)
  for flag in $(grep -oE -- '--[a-z][a-z-]*' <<<"$line" | sort -u); do
    flags_checked=$((flags_checked + 1))
    grep -q -- "$flag" <<<"$help" || { echo "FAILED: 'llmtrain $sub' has no $flag (in: $line)"; failed=$((failed + 1)); }
  done
done <<<"$lines"
# The k8s file lists arguments one per line.
for flag in $(sed -n '/- train$/,/^ *[a-zA-Z]*:/p' scripts/launch/k8s-mpijob.yaml | grep -oE -- '--[a-z][a-z-]*' | sort -u); do
  flags_checked=$((flags_checked + 1))
  "$llmtrain" train --help | grep -q -- "$flag" || { echo "FAILED: 'llmtrain train' has no $flag (k8s-mpijob.yaml)"; failed=$((failed + 1)); }
done
echo "checked $flags_checked flags of llmtrain command lines"
(( failed == 0 )) && echo "1 passed, 0 failed" || { echo "0 passed, $failed failed"; exit 1; }
