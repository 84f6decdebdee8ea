#!/usr/bin/env bash
# `make compat` for verl: a virtual environment of its own with verl[verl-core]==0.9.1 and
# Arctic RL's thin client + adapter (verl's transformers pin conflicts with vLLM's), then the
# tests. The Arctic RL server they start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/compat-verl-venv
STAMP=$VENV/.installed-verl-0.9.1
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade "pip==24.3.1"
  # torch exactly pinned first: the local CPU wheel (verl's `cpu` extra would pin torch 2.11.0).
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet "verl[verl-core]==0.9.1" "pytest==9.2.0" "pandas>=2" "pyarrow>=15"
  touch "$STAMP"
fi
# As a user installs them into verl's environment: Arctic RL's thin client (the base package, no extras),
# then the adapter's own distribution, both regular installs (Hydra finds the adapter's search-path plugin).
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps . ./adapters/verl
"$VENV/bin/python" -m pip install --quiet . ./adapters/verl
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/verl "$@"
# The same verl runs against a 2-rank, 2-replica job: only the server's configuration differs.
ARCTIC_RL_COMPAT_JOB=distributed "$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/verl \
  -k "main_ppo_grpo_steps_run_on_arctic_rl or through_arctic_rl" "$@"
