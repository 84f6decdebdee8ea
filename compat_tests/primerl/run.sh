#!/usr/bin/env bash
# `make compat` for PrimeRL: a virtual environment of its own with verifiers 0.4.0 and renderers 0.1.12
# (the rollout side PrimeRL's orchestrator runs) and Arctic RL's thin client, then the tests. The Arctic RL
# server they start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.cache/compat-primerl-venv
compat_tests/primerl/dependencies.sh
# As a user installs it into PrimeRL's environment: Arctic RL's thin client (the base package, no extras).
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps .
"$VENV/bin/python" -m pip install --quiet .
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/primerl "$@"
