#!/usr/bin/env bash
# scripts/gpu_check.sh on a simulated bare GPU node: the CUDA
# toolkit, NCCL and cuDNN only as Python wheels (site-packages/nvidia/{cu13,nccl,cudnn}), no
# nlohmann/CLI11/Catch2 packages (only a copied third_party/), no mpicxx, no network. Inside a
# private mount namespace (unshare -m, as root) the system's copies are hidden by bind mounts of
# empty folders (and an unexecutable file over mpicxx); a python3 on the PATH reports the wheel
# folder. Then `gpu_check.sh --dry-run` must list nothing missing, its probe (three lines of CUDA)
# must compile, link and run with the wheel toolkit (no driver here: the driver check says so),
# NVRTC must be found in the wheel, and `gpu_check.sh --build-only`
# must configure and build llmtrain and the [cuda] test binaries (sm_90 only), which must then
# start (their libraries found through the LD_LIBRARY_PATH that gpu_check sets; no GPU here, so
# their [cuda] cases skip).
#
# The wheels are made from this machine's own files: NCCL's and cuDNN's headers and libraries
# (versioned names only, as the wheels ship them) from beside nvcc; the toolkit laid out as the
# nvidia-cuda-nvcc / -runtime / -cublas wheels lay it out (nvidia/cu13/{bin,include,lib,nvvm}),
# or, with --cuda-site DIR, the real wheels installed in DIR (pip install --target DIR
# nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-nvvm nvidia-cuda-crt; cuBLAS is added from here).
#
# Usage: tests/gpu_bare_node_test.sh [--dry-run-only|--configure-only] [--no-static-runtime] [--cuda-site DIR] [--jobs N] [WORK_DIR]
#   --configure-only  after the dry run, only CMake's configure step as gpu_check runs it (CMake's
#             CUDA compiler test compiles and links a program with the wheel's runtime): minutes
#   --no-static-runtime  the wheel without libcudart_static.a (as some ship): the probe and the
#             build must link the shared runtime instead (CMakeLists.txt falls back by itself)
#   WORK_DIR  default build-bare-node/ (the build is kept there, for ccache and reruns)
# Slow (a CUDA build: 20 to 40 minutes on 2 cores, minutes with a warm ccache): not in ctest.
# Needs root, unshare(1), the CUDA toolkit with NCCL and cuDNN, and scripts/vendor_deps.sh's
# packages (to fill third_party/). CCACHE_BASEDIR and the compiler launchers pass through EXTRA_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
dry_only=0 configure_only=0 no_static=0 cuda_site="" jobs=2 work="$repo/build-bare-node"
while (($#)); do
  case "$1" in
    --dry-run-only) dry_only=1 ;;
    --no-static-runtime) no_static=1 ;;
    --configure-only) configure_only=1 ;;
    --cuda-site) cuda_site="$(cd "${2:?--cuda-site needs a folder}" && pwd)"; shift ;;
    --jobs) jobs="${2:?}"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_bare_node_test.sh: unknown option $1" >&2; exit 2 ;;
    *) work="$1" ;;
  esac
  shift
done

if [[ "${LLMTRAIN_BARE_NODE_INSIDE:-}" != 1 ]]; then
  # ---- outside: lay out the wheels, then start again inside a private mount namespace -----------
  [[ $(id -u) == 0 ]] || { echo "gpu_bare_node_test.sh: needs root (bind mounts in a mount namespace)" >&2; exit 2; }
  command -v unshare >/dev/null || { echo "gpu_bare_node_test.sh: needs unshare(1)" >&2; exit 2; }
  nvcc="$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")"
  [[ -x "$nvcc" ]] || { echo "gpu_bare_node_test.sh: no nvcc here to make the wheels from" >&2; exit 2; }
  cuda="$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)"
  inc="$cuda/include" lib="$cuda/lib64"
  [[ -d "$lib" ]] || lib="$cuda/lib"
  [[ -f "$inc/nccl.h" && -f "$inc/cudnn.h" ]] || { echo "gpu_bare_node_test.sh: nccl.h and cudnn.h are not beside $nvcc" >&2; exit 2; }
  scripts/vendor_deps.sh > /dev/null   # third_party/, as it would be copied to the node

  sim="$work/sim"
  rm -rf "$sim"
  site="$sim/site" orig="$sim/orig-cuda"   # orig: the toolkit, seen there only (bind-mounted inside)
  mkdir -p "$site/nvidia/nccl/include" "$site/nvidia/nccl/lib" "$site/nvidia/cudnn/include" "$site/nvidia/cudnn/lib" \
           "$sim/bin" "$sim/empty" "$orig"
  rel() { echo "$orig/${1#"$cuda"/}"; }  # this toolkit's file, as seen inside
  # NCCL and cuDNN wheels: headers, and the libraries under their versioned names only.
  for f in "$inc"/nccl*; do ln -s "$(rel "$(readlink -f "$f")")" "$site/nvidia/nccl/include/"; done
  ln -s "$(rel "$(readlink -f "$lib/libnccl.so.2")")" "$site/nvidia/nccl/lib/libnccl.so.2"
  for f in "$inc"/cudnn*.h; do ln -s "$(rel "$(readlink -f "$f")")" "$site/nvidia/cudnn/include/"; done
  for f in "$lib"/libcudnn*.so.9; do ln -s "$(rel "$(readlink -f "$f")")" "$site/nvidia/cudnn/lib/$(basename "$f")"; done
  # The toolkit, wheel-shaped.
  cu13="$site/nvidia/cu13"
  if [[ -n "$cuda_site" ]]; then
    cp -a "$cuda_site/nvidia/cu13" "$cu13"
  else
    mkdir -p "$cu13/bin" "$cu13/include" "$cu13/lib"
    # nvcc reads nvcc.profile beside its own file: copies, not links; the profile as the wheel has it.
    for tool in nvcc ptxas fatbinary nvlink cudafe++ bin2c; do cp "$cuda/bin/$tool" "$cu13/bin/"; done
    cp -r "$cuda/bin/crt" "$cu13/bin/"
    cat > "$cu13/bin/nvcc.profile" <<'PROFILE'

TOP              = $(_HERE_)/..

CICC_PATH        = $(TOP)/nvvm/bin
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice

LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(CICC_PATH):$(_HERE_):

INCLUDES        +=  "-I$(TOP)/$(_TARGET_DIR_)/include" $(_SPACE_)
SYSTEM_INCLUDES +=  "-isystem" "$(TOP)/$(_TARGET_DIR_)/include/cccl" $(_SPACE_)

LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/$(_TARGET_DIR_)/lib$(_TARGET_SIZE_)/stubs" "-L$(TOP)/$(_TARGET_DIR_)/lib$(_TARGET_SIZE_)"

CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
PROFILE
    ln -s "$(rel "$(readlink -f "$cuda/nvvm")")" "$cu13/nvvm"
    for f in "$inc"/*; do
      case "$(basename "$f")" in nccl*|cudnn*) continue ;; esac
      ln -s "$(rel "$(readlink -f "$f")")" "$cu13/include/"
    done
    for f in libcudart.so.13 libcudart_static.a libcudadevrt.a libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
      [[ -e "$lib/$f" ]] && ln -s "$(rel "$(readlink -f "$lib/$f")")" "$cu13/lib/$f"
    done
  fi
  ((no_static)) && rm -f "$cu13/lib/libcudart_static.a"
  # cuBLAS and CCCL, as the nvidia-cublas and nvidia-cuda-cccl wheels add them to nvidia/cu13.
  [[ -e "$cu13/include/cccl" || -L "$cu13/include/cccl" ]] || ln -s "$(rel "$(readlink -f "$inc/cccl")")" "$cu13/include/cccl"
  for f in "$inc"/cublas*.h; do [[ -e "$cu13/include/$(basename "$f")" || -L "$cu13/include/$(basename "$f")" ]] || ln -s "$(rel "$(readlink -f "$f")")" "$cu13/include/"; done
  for f in libcublas.so.13 libcublasLt.so.13; do ln -sf "$(rel "$(readlink -f "$lib/$f")")" "$cu13/lib/$f"; done
  # The interpreter that knows the wheels.
  real_python="$(command -v python3)"
  printf '#!/bin/sh\nPYTHONPATH=%q exec %q "$@"\n' "$site" "$real_python" > "$sim/bin/python3"
  chmod +x "$sim/bin/python3"
  : > "$sim/not-executable"

  export LLMTRAIN_BARE_NODE_INSIDE=1 SIM_ORIG_CUDA="$cuda" SIM_DIR="$sim"
  args=(--jobs "$jobs")
  ((dry_only)) && args+=(--dry-run-only)
  ((no_static)) && args+=(--no-static-runtime)
  ((configure_only)) && args+=(--configure-only)
  exec unshare --mount --net --propagation private "$0" "${args[@]}" "$work"
fi

# ---- inside: hide the system's copies ---------------------------------------------------------------
sim="$SIM_DIR" empty="$SIM_DIR/empty"
mount --bind "$SIM_ORIG_CUDA" "$sim/orig-cuda"
hidden=("$SIM_ORIG_CUDA" /usr/local/include)
for d in /usr/include/nlohmann /usr/include/CLI /usr/include/catch2 /usr/include/nccl.h \
         /usr/lib/cmake/Catch2 /usr/share/cmake/CLI11 /usr/share/cmake/nlohmann_json \
         /usr/lib/*/cmake/nlohmann_json /usr/lib/*/cmake/CLI11 /usr/lib/*/cmake/Catch2; do
  [[ -d "$d" ]] && hidden+=("$d")
done
for d in "${hidden[@]}"; do mount --bind "$empty" "$d"; done
# Programs the bare node lacks: MPI's compiler wrappers, and any nvcc outside the wheels (wrappers too).
for f in $(type -ap mpicxx mpic++ mpiCC nvcc | sort -u); do mount --bind "$sim/not-executable" "$f"; hidden+=("$f"); done
for lib in /usr/lib/*/libnccl.so* /usr/lib/*/libcudnn*.so*; do
  [[ -f "$lib" ]] && { mount --bind "$sim/not-executable" "$lib"; hidden+=("$lib"); }
done
unset CUDA_HOME CUDA_PATH NCCL_HOME CUDNN_HOME LIBRARY_PATH CPATH LD_LIBRARY_PATH
PATH="$sim/bin:$(tr : '\n' <<< "$PATH" | grep -v -i cuda | paste -sd: -)"
export PATH

echo "simulated bare node: hidden ${hidden[*]}"
echo "  python3 -> $(python3 -c 'import nvidia.nccl, nvidia.cudnn, nvidia.cu13; print(*[list(m.__path__)[0] for m in (nvidia.cu13, nvidia.nccl, nvidia.cudnn)])')"
echo "  runnable nvcc on the PATH: $([[ -x "$(command -v nvcc)" ]] && command -v nvcc || echo none); runnable mpicxx: $([[ -x "$(command -v mpicxx)" ]] && echo yes || echo no); /usr/include/nlohmann: $(find /usr/include/nlohmann -type f 2>/dev/null | wc -l) files"
if curl -s --max-time 5 -o /dev/null https://github.com 2>/dev/null; then echo "FAILED: the network is reachable"; exit 1; fi
echo "  network: unreachable"

status=0
echo "== scripts/gpu_check.sh --dry-run"
if scripts/gpu_check.sh --dry-run --build-dir "$work/build" 2>&1 | tee "$sim/dry-run.log"; then :; else status=1; fi
grep -q "^gpu_check: missing:" "$sim/dry-run.log" && { echo "FAILED: the dry run lists missing pieces"; status=1; }
grep -q "^gpu_check: nothing missing" "$sim/dry-run.log" || status=1
grep -q "^+ cmake --build .*--target llmtrain .*test_" "$sim/dry-run.log" || { echo "FAILED: no build command"; status=1; }
runtime=static
((no_static)) && runtime=shared
grep -q "^gpu_check: found: probe: compiled and linked (sm_90, $runtime runtime" "$sim/dry-run.log" ||
  { echo "FAILED: the probe did not compile, link ($runtime runtime) and run with the wheel toolkit"; status=1; }
grep -q "^gpu_check: found: NVRTC: .*/nvidia/cu13/lib/libnvrtc.so" "$sim/dry-run.log" || { echo "FAILED: NVRTC not found in the wheel"; status=1; }
grep -q "^gpu_check: note: no CUDA driver here" "$sim/dry-run.log" || { echo "FAILED: no driver check reported"; status=1; }
((status == 0)) || exit 1
(( ${dry_only:-0} )) && { echo "dry run: ok"; exit 0; }
if ((configure_only)); then
  echo "== CMake's configure step, as gpu_check.sh runs it"
  configure="$(grep -m 1 "^+ cmake -S . -B " "$sim/dry-run.log")"
  read -r -a configure_cmd <<< "${configure#+ }"
  rm -rf "$work/build"
  if ! "${configure_cmd[@]}" > "$sim/configure.log" 2>&1; then
    tail -n 40 "$sim/configure.log"; echo "FAILED: configure"; exit 1
  fi
  grep -E "CUDA runtime|CUDA  " "$sim/configure.log" || true
  if ((no_static)) && ! grep -q "linking the shared CUDA runtime" "$sim/configure.log"; then
    echo "FAILED: no fallback to the shared CUDA runtime"; exit 1
  fi
  echo "bare node: configure: ok"
  exit 0
fi

echo "== scripts/gpu_check.sh --build-only (JOBS=$jobs)"
export JOBS="$jobs"
# (--full: every test binary with [cuda] cases and bench_kernels are built; --budget: the build's
# cap, and a build from scratch on a few cores takes far more than the default 480 s.)
if ! nice -n 10 scripts/gpu_check.sh --build-only --full --budget 7200 --build-dir "$work/build" --out "$sim/gpu_check.json"; then
  tail -n 40 "$work/build/gpu_check/configure.log" "$work/build/gpu_check/build.log" 2>/dev/null
  echo "FAILED: gpu_check.sh --build-only"; exit 1
fi
grep -E "NCCL|cuDNN|CUDA  |MPI  |vendored" "$work/build/gpu_check/configure.log" || true
# The binaries start with the wheels' libraries (LD_LIBRARY_PATH as gpu_check sets it, read back from its JSON).
LD_LIBRARY_PATH="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["ld_library_path"])' "$sim/gpu_check.json")"
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd "$work/build/src/llmtrain" | grep -E "nccl|cudnn|cublas|cudart" || true
if ldd "$work/build/src/llmtrain" | grep -q "not found"; then echo "FAILED: unresolved libraries"; exit 1; fi
"$work/build/src/llmtrain" info || { echo "FAILED: llmtrain info"; exit 1; }
for t in "$work"/build/tests/test_*; do
  [[ -x "$t" && -f "$t" ]] || continue
  "$t" '[cuda]' > "$sim/$(basename "$t").log" 2>&1 || { cat "$sim/$(basename "$t").log"; echo "FAILED: $t [cuda]"; exit 1; }
  echo "$(basename "$t") [cuda]: $(tail -n 2 "$sim/$(basename "$t").log" | tr '\n' ' ')"
done
echo "bare node: configure, build and start: ok"
