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
# The adapter as a user installs it: a regular (non-editable) install, so Hydra finds its search-path plugin.
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps .
"$VENV/bin/python" -m pip install --quiet "pydantic>=2.10,<3" "pluggy>=1.5,<2" "httpx>=0.27,<1" "safetensors>=0.5"
ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python" "$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/verl "$@"
