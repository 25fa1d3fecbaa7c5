#!/usr/bin/env bash
# The ssh daemon of a multi-node container (Docker image: /usr/local/bin/llmtrain-sshd), run as
# the non-root user on port 2222. Its host key is never part of the image: a mounted secret
# /run/secrets/llmtrain_host_key (a private key, e.g. from `ssh-keygen -t ed25519`) when there
# is one, else a key generated now, on the container's first start, and kept for its lifetime.
# Arguments go to sshd (default: -D -e, in the foreground, logging to stderr).
set -euo pipefail
dir="${LLMTRAIN_SSHD_DIR:-$HOME/sshd}"
secret="${LLMTRAIN_HOST_KEY_SECRET:-/run/secrets/llmtrain_host_key}"
key="$dir/host_key"
umask 077
mkdir -p "$dir"
if [[ -f "$secret" ]]; then
  # sshd refuses a key that others may read, and a mounted secret often is: copy it, mode 600.
  cp "$secret" "$key.new" && chmod 600 "$key.new" && mv -f "$key.new" "$key"
  echo "llmtrain-sshd: host key from $secret" >&2
elif [[ ! -s "$key" ]]; then
  rm -f "$key" "$key.pub"
  ssh-keygen -q -t ed25519 -N "" -C "llmtrain-$(hostname)" -f "$key"
  echo "llmtrain-sshd: new host key $(ssh-keygen -l -f "$key.pub" | awk '{print $2}')" >&2
fi
(($# > 0)) || set -- -D -e
exec "${SSHD:-/usr/sbin/sshd}" -f "$dir/sshd_config" -h "$key" "$@"
