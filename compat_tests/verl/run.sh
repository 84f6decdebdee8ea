#!/usr/bin/env bash
# `make compat` for verl: a virtual environment of its own with verl[verl-core]==0.9.1 and
# Arctic RL's thin client + adapter (verl's transformers pin conflicts with vLLM's), then the
# tests. The Arctic RL server they start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
source compat_tests/verl/environment.sh
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/verl -k "not native_keys" "$@"
# Against a 2-rank, 2-replica job (only the server's configuration differs): verl's own config with the native
# keys, a whole GRPO run, and the training worker's calls.
ARCTIC_RL_COMPAT_JOB=distributed "$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/verl \
  -k "native_keys or through_arctic_rl" "$@"
