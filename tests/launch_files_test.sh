#!/usr/bin/env bash
# The launch files parse (bash -n, a YAML parser), and every `llmtrain SUBCOMMAND --flag` in the
# documentation (README.md, docs/*.md) and in the launch files is a flag that subcommand has. The
# Dockerfile makes no key at build time, and the container's sshd wrapper makes or takes its host
# key at start.
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
# Flags after `llmtrain SUB` on one line (README.md and docs/ pages, launch files) against SUB --help.
lines=$(grep -hoE '(llmtrain|build/src/llmtrain) (train|generate|eval|tokenize|export|plan|inspect|check-config|info)( [^|#;&]*)?' \
          README.md docs/*.md scripts/launch/* scripts/quickstart.sh)
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

# No private key in the image: no RUN instruction of the Dockerfile (continuation lines joined)
# generates a key, and no file the build context holds is one (COPY . . takes them all).
key_makers='ssh-keygen|dropbearkey|openssl +(genrsa|genpkey|ecparam|req)|certtool +--generate-privkey|wg +genkey'
runs=$(/usr/bin/python3 - Dockerfile <<'PY'
import re, sys
text = re.sub(r"\\\n", " ", open(sys.argv[1]).read())
for line in text.splitlines():
    if re.match(r"\s*RUN\b", line, re.I):
        print(" ".join(line.split()))
PY
)
[[ -n "$runs" ]] || { echo "FAILED: no RUN instruction found in the Dockerfile (parser broken?)"; failed=$((failed + 1)); }
if grep -qE "$key_makers" <<<"$runs"; then
  echo "FAILED: the Dockerfile makes a key at build time (it would be in a layer): $(grep -oE "$key_makers" <<<"$runs" | head -n 1)"
  failed=$((failed + 1))
else
  echo "ok: no key generated in the $(wc -l <<<"$runs") RUN instructions of the Dockerfile"
fi
repo_files() { git ls-files -z 2>/dev/null || find . \( -name 'build*' -o -name .git \) -prune -o -type f -print0; }
keys=$(repo_files | xargs -0 grep -lE -- '-----BEGIN ([A-Z]+ )?PRIVATE KEY-----' 2>/dev/null)
if [[ -n "$keys" ]]; then echo "FAILED: private keys in the build context: $keys"; failed=$((failed + 1)); else echo "ok: no private key among the repository's files"; fi
# The image's sshd gets its host key at start: the Dockerfile installs the wrapper that makes it,
# and the Kubernetes launcher runs mpirun.sh, which the image holds where the YAML says.
check grep -q "COPY scripts/launch/container-sshd.sh /usr/local/bin/llmtrain-sshd" Dockerfile
check grep -q "COPY scripts/launch/mpirun.sh /opt/llmtrain/launch/mpirun.sh" Dockerfile
check grep -qE -- "- /opt/llmtrain/launch/mpirun.sh$" scripts/launch/k8s-mpijob.yaml

# The Dockerfile without an engine (hadolint's kind of checks): every base image a pinned tag (no
# ":latest", none left out), the CUDA image still the default, a non-root USER before the entry
# point, nothing secret copied in, and a .dockerignore that keeps build folders, runs and git
# history out of the context.
froms=$(grep -E '^ARG (BUILD|RUNTIME)_IMAGE=' Dockerfile | cut -d= -f2-)
two_base_images() { [[ "$(grep -c . <<<"$froms")" == 2 ]]; }
check two_base_images
pinned() { ! grep -qvE '^[a-z0-9./_-]+:[A-Za-z0-9${}._-]*[0-9][A-Za-z0-9${}._-]*$' <<<"$froms"; }
check pinned
cuda_default() { grep -qx 'ARG BUILD_IMAGE=nvidia/cuda:${CUDA_IMAGE_TAG}-devel-ubuntu24.04' Dockerfile &&
                 grep -qx 'ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_IMAGE_TAG}-runtime-ubuntu24.04' Dockerfile &&
                 grep -qx 'ARG LLMTRAIN_CUDA=ON' Dockerfile && grep -qE '^ARG CUDA_IMAGE_TAG=[0-9]' Dockerfile; }
check cuda_default
non_root_user() { local user; user=$(grep -E '^USER ' Dockerfile | tail -n 1 | awk '{print $2}');
                  [[ -n "$user" && "$user" != root && "$user" != 0 ]] &&
                  (($(grep -nE '^USER ' Dockerfile | tail -n 1 | cut -d: -f1) < $(grep -nE '^ENTRYPOINT ' Dockerfile | cut -d: -f1))); }
check non_root_user
no_secret_copied() { ! grep -iE '^(COPY|ADD) ' Dockerfile | grep -qiE 'id_(rsa|ed25519|ecdsa)|\.pem|secret|host_key|authorized_keys'; }
check no_secret_copied
dockerignore() { local p; for p in .git build/ build-\*/ runs/ data/; do grep -qxF "$p" .dockerignore || return 1; done; }
check dockerignore
# mpirun.sh refuses what it does not know, elastic options included, with exit 2.
bad_options() { local o; for o in "--bogus" "--max-restarts x" "--min-nodes" "-n"; do
                  # shellcheck disable=SC2086
                  bash scripts/launch/mpirun.sh $o -- info >/dev/null 2>&1; [[ $? == 2 ]] || return 1; done; }
check bad_options

# container-sshd.sh, with a stand-in for sshd: a key made on the first start (mode 600), kept on
# the next, and a mounted secret used instead when there is one.
check bash -n scripts/launch/container-sshd.sh
sshd_dir=$(mktemp -d)
cat > "$sshd_dir/fake-sshd" <<'SH'
#!/usr/bin/env bash
echo "sshd $*" > "$LLMTRAIN_SSHD_DIR/args"
SH
chmod +x "$sshd_dir/fake-sshd"
sshd_run() { SSHD="$sshd_dir/fake-sshd" LLMTRAIN_SSHD_DIR="$sshd_dir/home" LLMTRAIN_HOST_KEY_SECRET="$sshd_dir/secret" \
               bash scripts/launch/container-sshd.sh 2>/dev/null; }
if command -v ssh-keygen >/dev/null; then
  sshd_run
  first=$(ssh-keygen -l -f "$sshd_dir/home/host_key" 2>/dev/null)
  sshd_run
  second=$(ssh-keygen -l -f "$sshd_dir/home/host_key" 2>/dev/null)
  mode=$(stat -c %a "$sshd_dir/home/host_key" 2>/dev/null)
  args=$(cat "$sshd_dir/home/args" 2>/dev/null)
  if [[ -n "$first" && "$first" == "$second" && "$mode" == 600 && "$args" == "sshd -f $sshd_dir/home/sshd_config -h $sshd_dir/home/host_key -D -e" ]]; then
    echo "ok: container-sshd.sh made a host key at start (mode 600), kept it, and ran: $args"
  else
    echo "FAILED: container-sshd.sh: key '$first' then '$second', mode $mode, sshd run as '$args'"; failed=$((failed + 1))
  fi
  ssh-keygen -q -t ed25519 -N "" -f "$sshd_dir/secret" && chmod 644 "$sshd_dir/secret"
  sshd_run
  if cmp -s "$sshd_dir/secret" "$sshd_dir/home/host_key" && [[ "$(stat -c %a "$sshd_dir/home/host_key")" == 600 ]]; then
    echo "ok: container-sshd.sh took the mounted secret as the host key (copied, mode 600)"
  else
    echo "FAILED: container-sshd.sh did not use the mounted secret as the host key"; failed=$((failed + 1))
  fi
else
  echo "SKIPPED: no ssh-keygen for scripts/launch/container-sshd.sh"
fi
rm -rf "$sshd_dir"
(( failed == 0 )) && echo "1 passed, 0 failed" || { echo "0 passed, $failed failed"; exit 1; }
