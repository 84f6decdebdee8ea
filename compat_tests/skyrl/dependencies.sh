#!/usr/bin/env bash
# SkyRL's own virtual environment on Python 3.12: skyrl 0.4.0 and its `skyrl-train` extra less what is only for GPUs,
# built once (a stamp marks it done): downloads and unpacking, nothing of Arctic RL's. Run from the repository
# root, by run.sh and by `make compat-dependencies` (which CI runs beside the test suites).
set -euo pipefail
cd "$(dirname "$0")/../.."
source compat_tests/python312.sh
source scripts/uv.sh
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
  # skyrl_train.txt: SkyRL's pins. With uv (scripts/uv.sh): the torch it takes is prime-rl's environment's too.
  uv_pip "$VENV" -r compat_tests/skyrl/skyrl_train.txt
  # what main_base's driver and Ray actors import, at once
  uv_warm "$VENV" skyrl.train.entrypoints.main_base pytest
  touch "$STAMP"
fi
