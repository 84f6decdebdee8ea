#!/usr/bin/env bash
# verl's own virtual environment with verl[verl-core]==0.9.1 (verl's transformers pin conflicts with vLLM's), built
# once (a stamp marks it done): downloads and unpacking, nothing of Arctic RL's. Run from the repository root, by
# environment.sh and by `make compat-dependencies` (which CI runs beside the test suites).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/uv.sh
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/compat-verl-venv
STAMP=$VENV/.installed-verl-0.9.1
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1
  # torch exactly pinned: the local CPU wheel (verl's `cpu` extra would pin torch 2.11.0).
  mapfile -t local_wheels < <(pip_find_links)
  uv_pip "$VENV" "${local_wheels[@]}" "torch==2.13.0" "verl[verl-core]==0.9.1" "pytest==9.2.0" "pandas>=2" \
    "pyarrow>=15"
  # what main_ppo's driver and Ray actors import, at once
  uv_warm "$VENV" verl.trainer.main_ppo verl.trainer.ppo.v1.agent_loop_tq verl.experimental.agent_loop.agent_loop \
    verl.experimental.reward_loop.reward_loop verl.single_controller.ray.base verl.workers.rollout.router \
    transfer_queue.controller transfer_queue.storage.simple_storage pandas pytest
  touch "$STAMP"
fi
