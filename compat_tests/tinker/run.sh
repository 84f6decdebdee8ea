#!/usr/bin/env bash
# `make compat` for Tinker: tinker-cookbook's own RL and supervised training loops, unmodified, against
# `arctic-rl serve` (its Tinker routes), in the Tinker environment (dependencies.sh). The server runs in the main
# environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
compat_tests/tinker/dependencies.sh
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
TINKER_TELEMETRY=0 .cache/compat-tinker-venv/bin/python -m pytest -q -p no:cacheprovider compat_tests/tinker "$@"
