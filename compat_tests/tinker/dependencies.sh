#!/usr/bin/env bash
# Tinker's side in a virtual environment of its own, built once (a stamp marks it done): the `tinker` SDK and
# tinker-cookbook from the package index, unmodified, with the local CPU torch. Nothing of Arctic RL's goes in: the
# SDK is the client. tinker-cookbook 0.6.x needs tml-renderers>=0.4.1, which the index does not have; 0.5.8 is the
# newest that installs (it takes the same SDK). Run from the repository root, by run.sh and by
# `make compat-dependencies`.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/uv.sh
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/compat-tinker-venv
STAMP=$VENV/.installed-tinker-0.38.0-cookbook-0.5.8
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1
  mapfile -t local_wheels < <(pip_find_links)  # the local CPU torch
  uv_pip "$VENV" "${local_wheels[@]}" "torch==2.13.0" "tinker==0.38.0" "tinker-cookbook==0.5.8" "pytest==9.2.0"
  # what the tenants' loops import, at once
  uv_warm "$VENV" tinker_cookbook.rl.train tinker_cookbook.supervised.train pytest
  touch "$STAMP"
fi
