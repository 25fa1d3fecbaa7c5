#!/usr/bin/env bash
# The default (CUDA) image's build configures from what its build context holds: the source tree
# copied without what .dockerignore drops (tests/ among it), then configured as the Dockerfile's
# build stage does it (-DLLMTRAIN_CUDA=ON, -DBUILD_TESTING=OFF; configure only, nothing is
# compiled). A CMakeLists.txt naming a file the context lacks fails here, as `docker build` would.
# .dockerignore's rules as Docker reads them: a pattern is anchored at the context's root; `*` and
# `?` stay within one path component, `**` spans any number of them; a pattern that matches a
# folder drops everything under it; `!PATTERN` takes back what an earlier pattern dropped, and
# the last pattern that matches a path decides.
# Exit 77 (skipped) where there is no nvcc (CUDACXX, PATH or /usr/local/cuda/bin).
# Usage: docker_context_test.sh SOURCE_DIR
set -uo pipefail
source_dir=$(cd "${1:-$(dirname "$0")/..}" && pwd)
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; exit 1; }

nvcc="${CUDACXX:-$(command -v nvcc || true)}"
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" && -x "$nvcc" ]] || skip "no nvcc (CUDACXX, PATH or /usr/local/cuda/bin): the CUDA configuration cannot be configured here"
[[ -f "$source_dir/.dockerignore" && -f "$source_dir/Dockerfile" ]] || fail "no .dockerignore or Dockerfile in $source_dir"
grep -q -- '-DLLMTRAIN_CUDA=${LLMTRAIN_CUDA}' "$source_dir/Dockerfile" ||
  fail "the Dockerfile's build stage no longer configures with -DLLMTRAIN_CUDA=\${LLMTRAIN_CUDA}: update this test"

work=$(mktemp -d "${TMPDIR:-/tmp}/llmtrain-docker-context.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Each pattern as an anchored extended regular expression; `keep` says whether it is an exception.
regexes=() keeps=()
while IFS= read -r line || [[ -n "$line" ]]; do
  line="${line%$'\r'}"
  line="${line#"${line%%[![:space:]]*}"}"
  line="${line%"${line##*[![:space:]]}"}"
  [[ -z "$line" || "$line" == \#* ]] && continue
  keep=0
  if [[ "$line" == !* ]]; then keep=1; line="${line#!}"; fi
  line="${line#/}"
  line="${line%/}"
  regex="" i=0
  while ((i < ${#line})); do
    c="${line:i:1}"
    if [[ "${line:i:3}" == "**/" ]]; then regex+="(.*/)?"; i=$((i + 3)); continue; fi
    if [[ "${line:i:2}" == "**" ]]; then regex+=".*"; i=$((i + 2)); continue; fi
    case "$c" in
      "*") regex+="[^/]*" ;;
      "?") regex+="[^/]" ;;
      [.+\(\)\{\}\|^\$]) regex+="\\$c" ;;
      *) regex+="$c" ;;
    esac
    i=$((i + 1))
  done
  regexes+=("^${regex}\$") keeps+=("$keep")
done < "$source_dir/.dockerignore"
((${#regexes[@]} > 0)) || fail ".dockerignore has no patterns"

# Whether the context drops this path (relative to the root): the last pattern matching the path
# or a folder above it decides.
dropped() {
  local path="$1" prefix="" part verdict=0 k
  local -a parts
  IFS=/ read -r -a parts <<< "$path"
  for part in "${parts[@]}"; do
    prefix="${prefix:+$prefix/}$part"
    for k in "${!regexes[@]}"; do
      [[ "$prefix" =~ ${regexes[$k]} ]] && verdict=$((1 - keeps[k]))
    done
  done
  return $((1 - verdict))
}

# The context's files, walked from the root; without exceptions a dropped folder is not walked
# (build folders are large).
has_exceptions=0
for k in "${keeps[@]}"; do ((k)) && has_exceptions=1; done
files=()
walk() {
  local rel entry
  for entry in "$source_dir${1:+/$1}"/* "$source_dir${1:+/$1}"/.[!.]* "$source_dir${1:+/$1}"/..?*; do
    [[ -e "$entry" || -L "$entry" ]] || continue
    rel="${entry#"$source_dir"/}"
    if [[ -d "$entry" && ! -L "$entry" ]]; then
      ((has_exceptions == 0)) && dropped "$rel" && continue
      walk "$rel"
    elif ! dropped "$rel"; then
      files+=("$rel")
    fi
  done
}
walk ""
((${#files[@]} > 0)) || fail "the build context is empty"
mkdir "$work/context"
(cd "$source_dir" && printf '%s\0' "${files[@]}" | tar --null -T - -cf -) | tar -xf - -C "$work/context" ||
  fail "copying the build context"
[[ -f "$work/context/CMakeLists.txt" ]] || fail "the build context has no CMakeLists.txt"
echo "build context: ${#files[@]} files (${#regexes[@]} .dockerignore patterns)"

# The Dockerfile's configure, with the CUDA flavour's flags.
if ! cmake -S "$work/context" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DLLMTRAIN_CUDA=ON \
     -DCMAKE_CUDA_COMPILER="$nvcc" > "$work/configure.log" 2>&1; then
  cat "$work/configure.log"
  fail "cmake -DLLMTRAIN_CUDA=ON does not configure on the Docker build context"
fi
echo "ok: cmake -DLLMTRAIN_CUDA=ON configures on the Docker build context"
