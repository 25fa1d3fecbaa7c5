#!/usr/bin/env bash
# Gathers llmtrain's header-only dependencies into one folder that can be copied to a machine
# without them (a GPU node with only a compiler, CMake and the CUDA toolkit, possibly offline):
#   DIR/include/nlohmann/json.hpp     nlohmann/json (3.10 or newer)
#   DIR/include/CLI/CLI.hpp           CLI11
#   DIR/include/catch2/catch.hpp      Catch2 v2 single header (tests)
#   DIR/cmake/Catch.cmake             Catch2's test discovery, where the system has it (optional:
#                                     without it each test binary is one ctest test)
#   DIR/SOURCES.txt                   where each came from, its version and sha256
# Each is copied from the system's packages where they are installed (Debian/Ubuntu:
# nlohmann-json3-dev, libcli11-dev, catch2 v2), else downloaded with curl from its pinned release
# and checked against the sha256 below. CMake uses DIR only for what it does not find installed:
#   cmake -S . -B build -DLLMTRAIN_VENDOR_DIR=DIR     (DIR = third_party/ in the repo needs no flag)
#
# Usage: scripts/vendor_deps.sh [DIR] [--download] [--allow-unverified] [--with-mpi]
#   DIR                 default: third_party/ in the repository (git-ignored)
#   --download          download even where a system copy exists
#   --allow-unverified  accept a download whose sha256 is not pinned here (prints it, to pin)
#   --with-mpi          also say how to bring Open MPI (only multi-process runs need it)
# Environment: GITHUB_MIRROR (default https://github.com) replaces the host part of the download
# URLs, for a site mirror of the release files (a file:// folder works too).
# Optional libraries are not vendored: without OpenBLAS the CPU matmul is a plain loop, without
# zlib CRC-32 is our own, without PCRE2 there are no GPT-2 BPE tokenizers (CMake says so).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

dir="$repo/third_party"
download=0 allow_unverified=0 with_mpi=0
for arg in "$@"; do
  case "$arg" in
    --download) download=1 ;;
    --allow-unverified) allow_unverified=1 ;;
    --with-mpi) with_mpi=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "vendor_deps.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) dir="$arg" ;;
  esac
done
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

# Pinned releases. The machine that wrote this list had no internet: json.hpp's sha256 is the one
# two independent published pins agree on; catch.hpp's is that of Debian 12's copy, whose SHA-1
# and MD5 equal the ones published for the release file. CLI11's is not pinned yet (empty: the
# download is refused unless --allow-unverified, which prints the hash to pin).
mirror="${GITHUB_MIRROR:-https://github.com}"
json_url="$mirror/nlohmann/json/releases/download/v3.11.3/json.hpp"
json_sha256="9bea4c8066ef4a1c206b2be5a36302f8926f7fdc6087af5d20b417d0cf103ea6"
cli11_url="$mirror/CLIUtils/CLI11/releases/download/v2.4.2/CLI11.hpp"
cli11_sha256=""
catch2_url="$mirror/catchorg/Catch2/releases/download/v2.13.10/catch.hpp"
catch2_sha256="3725c0f0a75f376a5005dde31ead0feb8f7da7507644c201b814443de8355170"

sources="$dir/SOURCES.txt"
{
  echo "# Filled by scripts/vendor_deps.sh on $(date -u +%Y-%m-%dT%H:%MZ) ($(uname -n))."
  echo "# Used by llmtrain's CMake only for packages it does not find installed."
} > "$sources"

record() {  # record NAME VERSION ORIGIN FILE
  printf '%-10s %-10s %s  sha256 %s\n' "$1" "$2" "$3" "$(sha256sum "$4" | cut -d' ' -f1)" >> "$sources"
}

# download URL SHA256 DEST: fetch into DEST (atomically), checking the hash.
download_file() {
  local url="$1" want="$2" dest="$3" tmp got
  command -v curl >/dev/null || { echo "vendor_deps.sh: curl is needed to download $url" >&2; return 1; }
  mkdir -p "$(dirname "$dest")"
  tmp="$(mktemp "$dest.XXXXXX")"
  if ! curl -fsSL --retry 2 --connect-timeout 20 -o "$tmp" "$url"; then
    rm -f "$tmp"
    echo "vendor_deps.sh: cannot download $url (no internet here? run this script where the packages or" \
         "the internet are, and copy $dir along)" >&2
    return 1
  fi
  got="$(sha256sum "$tmp" | cut -d' ' -f1)"
  if [[ -n "$want" && "$got" != "$want" ]]; then
    rm -f "$tmp"
    echo "vendor_deps.sh: $url: sha256 $got, expected $want: refusing it" >&2
    return 1
  fi
  if [[ -z "$want" ]]; then
    if ((!allow_unverified)); then
      rm -f "$tmp"
      echo "vendor_deps.sh: $url has no pinned sha256 here (downloaded: $got); check it against the" \
           "release page and pin it in scripts/vendor_deps.sh, or pass --allow-unverified" >&2
      return 1
    fi
    echo "vendor_deps.sh: warning: $url accepted UNVERIFIED (sha256 $got)" >&2
  fi
  mv "$tmp" "$dest"
}

header_version() {  # header_version FILE MAJOR_MACRO MINOR_MACRO [PATCH_MACRO]: "3.11.2"
  local file="$1"; shift
  local parts=() m
  for m in "$@"; do
    parts+=("$(grep -rhoE "#define $m +[0-9]+" "$file" | head -n 1 | grep -oE '[0-9]+$' || echo '?')")
  done
  (IFS=.; echo "${parts[*]}")
}

# nlohmann/json: Debian's package holds the multi-file headers (json.hpp includes detail/...):
# the whole folder is copied. The release's json.hpp is the single-file amalgamation.
rm -rf "$dir/include/nlohmann"
if ((!download)) && [[ -f /usr/include/nlohmann/json.hpp ]]; then
  mkdir -p "$dir/include"
  cp -r /usr/include/nlohmann "$dir/include/"
  version="$(header_version /usr/include/nlohmann NLOHMANN_JSON_VERSION_MAJOR NLOHMANN_JSON_VERSION_MINOR NLOHMANN_JSON_VERSION_PATCH)"
  record nlohmann "$version" "copied from /usr/include/nlohmann" "$dir/include/nlohmann/json.hpp"
else
  download_file "$json_url" "$json_sha256" "$dir/include/nlohmann/json.hpp"
  record nlohmann 3.11.3 "$json_url" "$dir/include/nlohmann/json.hpp"
fi

# CLI11: the package's folder of headers, or the release's single header under the same name.
rm -rf "$dir/include/CLI"
if ((!download)) && [[ -f /usr/include/CLI/CLI.hpp ]]; then
  mkdir -p "$dir/include"
  cp -r /usr/include/CLI "$dir/include/"
  version="$(grep -rhoE '#define CLI11_VERSION "[^"]+"' /usr/include/CLI | head -n 1 | cut -d'"' -f2)"
  record CLI11 "${version:-?}" "copied from /usr/include/CLI" "$dir/include/CLI/CLI.hpp"
else
  download_file "$cli11_url" "$cli11_sha256" "$dir/include/CLI/CLI.hpp"
  record CLI11 2.4.2 "$cli11_url" "$dir/include/CLI/CLI.hpp"
fi

# Catch2 v2: one header (v3 is a compiled library: not vendorable this way).
rm -rf "$dir/include/catch2" "$dir/cmake"
catch_system=/usr/include/catch2/catch.hpp
if ((!download)) && [[ -f "$catch_system" ]]; then
  mkdir -p "$dir/include/catch2"
  cp "$catch_system" "$dir/include/catch2/"
  record Catch2 "$(header_version "$catch_system" CATCH_VERSION_MAJOR CATCH_VERSION_MINOR CATCH_VERSION_PATCH)" \
    "copied from $catch_system" "$dir/include/catch2/catch.hpp"
  for cmake_dir in /usr/lib/cmake/Catch2 /usr/lib/*/cmake/Catch2 /usr/share/cmake/Catch2; do
    if [[ -f "$cmake_dir/Catch.cmake" && -f "$cmake_dir/CatchAddTests.cmake" ]]; then
      mkdir -p "$dir/cmake"
      cp "$cmake_dir/Catch.cmake" "$cmake_dir/CatchAddTests.cmake" "$dir/cmake/"
      record Catch.cmake - "copied from $cmake_dir" "$dir/cmake/Catch.cmake"
      break
    fi
  done
else
  download_file "$catch2_url" "$catch2_sha256" "$dir/include/catch2/catch.hpp"
  record Catch2 2.13.10 "$catch2_url" "$dir/include/catch2/catch.hpp"
fi

# The licenses travel with the headers.
mkdir -p "$dir/licenses"
for pkg in nlohmann-json3-dev libcli11-dev catch2; do
  [[ -f "/usr/share/doc/$pkg/copyright" ]] && cp "/usr/share/doc/$pkg/copyright" "$dir/licenses/$pkg.copyright"
done

echo "vendor_deps.sh: $dir holds:"
sed -n '3,$p' "$sources" | sed 's/^/  /'
echo "vendor_deps.sh: copy it along with the source tree; CMake uses $([[ "$dir" == "$repo/third_party" ]] && echo "it without flags" || echo "it with -DLLMTRAIN_VENDOR_DIR=$dir")"

if ((with_mpi)); then
  cat <<'EOF'
vendor_deps.sh: Open MPI is not vendored. One GPU needs no MPI: configure with -DLLMTRAIN_MPI=OFF
  (scripts/gpu_check.sh does so where mpicxx is missing). Several GPUs in one process group need it
  (NCCL's id is exchanged over MPI); to bring it offline from a Debian/Ubuntu machine of the same release:
    apt-get download libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common libpmix2 libhwloc15 libevent-*
    then on the node: dpkg -i *.deb   (or build Open MPI from its release tarball into a prefix, put
    PREFIX/bin on PATH, and configure with -DMPI_CXX_COMPILER=PREFIX/bin/mpicxx)
EOF
fi
