#!/usr/bin/env bash
# Installs every build and test dependency of llmtrain from the distribution's packages.
# Idempotent: packages already present are skipped. Uses sudo when not run as root.
# Debian 12 and Ubuntu 22.04/24.04 are supported. The CUDA toolkit is not installed here: it is
# found where it already is (CUDA_HOME, else /usr/local/cuda); without it the build is CPU-only.
set -euo pipefail

packages=(
  build-essential g++ cmake pkg-config git ca-certificates
  libcli11-dev nlohmann-json3-dev catch2
  libopenmpi-dev openmpi-bin
  libopenblas-dev libopenblas0-openmp libpcre2-dev zlib1g-dev libzstd-dev
  libonnx-dev libprotobuf-dev protobuf-compiler
  python3 python3-numpy python3-yaml procps
  slurm-wlm munge  # tests/slurm_test.sh runs scripts/launch/slurm.sbatch under a real single-node Slurm
  fortunes
  # tests/container_test.sh builds the Docker image and runs it on two "nodes" with rootful podman
  # (the runc runtime; netavark and iptables for its networks) on a debootstrap'ed Debian base.
  podman runc debootstrap netavark aardvark-dns iptables
)
# Optional: PyTorch for golden files and the CPU benchmark (`scripts/setup.sh --with-torch`).
# Optional: the ONNX Python packages and transformers for tests/onnx_export_test.py, and
# tensorboard for tests/tensorboard_reader_test.py (`scripts/setup.sh --with-onnx`), from PyPI
# into the system Python 3 (Debian packages none).
# Optional: lm-evaluation-harness 0.4.x for tests/hellaswag_harness_test.py (and transformers for
# tests/choice_eval_test.py), in a virtual environment .venv-lm-eval at the repository's root that
# sees the system's packages, so that Debian's PyTorch serves it (`scripts/setup.sh --with-lm-eval`).
# Optional: a PyTorch >= 2.9 from PyPI (its CPU-only wheel) with torch.optim.Muon, for
# tests/muon_reference_test.py, in a virtual environment .venv-torch at the repository's root
# (`scripts/setup.sh --with-torch-muon`; Debian's python3-torch is older and has no Muon).
# Optional: transformers 5.x (with safetensors) beside that PyTorch in the same .venv-torch, for
# tests/hf_training_reference_test.py (`scripts/setup.sh --with-transformers5`; it installs the
# PyTorch too when the venv has none). Debian's transformers, and the 4.44.2 that --with-onnx puts
# into the system Python for Debian's PyTorch 1.13, know no Qwen3.
# tiktoken for scripts/bench_tokenize.sh (`scripts/setup.sh --with-tiktoken`), from PyPI into .venv-tiktoken.
with_onnx=0
with_lm_eval=0
with_torch_muon=0
with_transformers5=0
with_tiktoken=0
for arg in "$@"; do
  case "$arg" in
    --with-torch) packages+=(python3-torch python3-matplotlib) ;;
    --with-onnx) with_onnx=1; packages+=(python3-pip) ;;
    --with-lm-eval) with_lm_eval=1; packages+=(python3-torch python3-venv python3-pip) ;;
    --with-torch-muon) with_torch_muon=1; packages+=(python3-venv python3-pip) ;;
    --with-transformers5) with_transformers5=1; packages+=(python3-venv python3-pip) ;;
    --with-tiktoken) with_tiktoken=1; packages+=(python3-venv python3-pip zstd) ;;
    *) echo "setup.sh: unknown option $arg (known: --with-torch, --with-onnx, --with-lm-eval, --with-torch-muon," \
            "--with-transformers5, --with-tiktoken)" >&2; exit 2 ;;
  esac
done

sudo_cmd=()
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup.sh: not root and sudo is missing" >&2; exit 1; }
  sudo_cmd=(sudo)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup.sh: installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup.sh: all ${#packages[@]} packages already installed"
fi

cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if [[ -x "$cuda_home/bin/nvcc" ]]; then
  echo "setup.sh: CUDA toolkit found at $cuda_home ($("$cuda_home/bin/nvcc" --version | tail -n 2 | head -n 1))"
else
  echo "setup.sh: no CUDA toolkit at $cuda_home: the build will be CPU-only (set CUDA_HOME to use another)"
fi

if ((with_onnx)); then
  # numpy is held below 2: a numpy 2 from PyPI would shadow Debian's and break Debian's PyTorch
  # (built against numpy 1); onnx needs at least 1.25. A PyTorch already there is pinned so that
  # pip never replaces it. transformers 4.44.2 (the test's Hugging Face side) runs on Debian 12's
  # PyTorch 1.13; later releases want PyTorch 2. tensorboard (its event-file readers, for
  # tests/tensorboard_reader_test.py) needs neither TensorFlow nor PyTorch.
  echo "setup.sh: installing onnx, onnxruntime, transformers and tensorboard from PyPI for /usr/bin/python3"
  constraints=$(mktemp)
  echo 'numpy>=1.25,<2' >"$constraints"
  if torch_version=$(/usr/bin/python3 -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "torch==$torch_version" >>"$constraints"
  fi
  chmod a+r "$constraints"
  "${sudo_cmd[@]}" /usr/bin/python3 -m pip install --quiet --break-system-packages -c "$constraints" \
    onnx onnxruntime 'numpy>=1.25,<2' transformers==4.44.2 tensorboard
  rm -f "$constraints"
fi

if ((with_lm_eval)); then
  # The harness's Hugging Face backend needs transformers and accelerate besides; both are held
  # to releases that run on Debian 12's PyTorch 1.13 (transformers 4.44.2 as above, accelerate
  # below 1.0), which is pinned so that pip never replaces it, as is numpy below 2 (and so
  # pyarrow below 20: later releases need numpy 2).
  venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-lm-eval"
  echo "setup.sh: installing lm-evaluation-harness 0.4.x from PyPI into $venv"
  [[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv --system-site-packages "$venv"
  constraints=$(mktemp)
  echo 'numpy>=1.25,<2' >"$constraints"
  torch_version=$(/usr/bin/python3 -c 'import torch; print(torch.__version__)')
  echo "torch==$torch_version" >>"$constraints"
  "$venv/bin/python" -m pip install --quiet -c "$constraints" 'lm-eval>=0.4,<0.5' transformers==4.44.2 \
    'accelerate>=0.26,<1' 'numpy>=1.25,<2' 'pyarrow>=15,<20'
  rm -f "$constraints"
  "$venv/bin/python" -c 'import importlib.metadata as m, lm_eval.models.huggingface; print("setup.sh: lm-eval", m.version("lm_eval"))'
fi

if ((with_tiktoken)); then
  # tiktoken, the reference for scripts/bench_tokenize.sh's GPT-2 BPE speed, in its own venv.
  venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-tiktoken"
  echo "setup.sh: installing tiktoken from PyPI into $venv"
  [[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet tiktoken
  "$venv/bin/python" -c 'import importlib.metadata as m; print("setup.sh: tiktoken", m.version("tiktoken"))'
fi

if ((with_torch_muon)); then
  # Its own venv without the system's packages: a PyTorch 2.9 beside Debian's older one would
  # shadow it for the other tests. PyPI's wheel (about 4 GB with its CUDA libraries) runs on the CPU;
  # TORCH_INDEX_URL may name a CPU-only wheel index instead, where one can be reached.
  venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-torch"
  echo "setup.sh: installing PyTorch >= 2.9 and numpy from PyPI into $venv"
  [[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} 'torch>=2.9'
  "$venv/bin/python" -m pip install --quiet numpy
  "$venv/bin/python" -c 'import torch; assert hasattr(torch.optim, "Muon"); print("setup.sh: torch", torch.__version__, "with torch.optim.Muon")'
fi

if ((with_transformers5)); then
  # The same venv as --with-torch-muon (one PyTorch from PyPI serves both tests); transformers is
  # held to 5.x, whose Qwen3 config reads the rotary base from rope_parameters.
  venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-torch"
  echo "setup.sh: installing PyTorch >= 2.9 and transformers 5.x from PyPI into $venv"
  [[ -x "$venv/bin/python" ]] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} 'torch>=2.9'
  "$venv/bin/python" -m pip install --quiet numpy safetensors 'transformers>=5,<6'
  "$venv/bin/python" -c 'import torch, transformers; from transformers import Qwen3ForCausalLM; print("setup.sh: torch", torch.__version__, "transformers", transformers.__version__)'
fi
