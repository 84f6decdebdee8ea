#!/usr/bin/env bash
# `make compat` for PrimeRL, in its two environments (dependencies.sh), each with Arctic RL's thin client installed
# as a user installs it: the rollout side (verifiers 0.4.0, renderers 0.1.12) against the server's routes, then
# prime-rl 0.8.0's trainer side (its packer, senders and losses) against the arctic-rl-primerl adapter. The Arctic
# RL server the tests start runs in the main environment (.venv, `make install`).
set -euo pipefail
cd "$(dirname "$0")/../.."
compat_tests/primerl/dependencies.sh
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
VENV=.cache/compat-primerl-venv
source compat_tests/client.sh
install_client "$VENV"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider compat_tests/primerl/test_verifiers.py "$@"
PRIME_RL=.cache/compat-prime-rl-venv
if [ ! -f "$PRIME_RL/.installed-prime-rl-559b447-torch-2.13.0" ]; then
  echo "compat_tests/primerl: SKIPPED the trainer-side tests: prime-rl cannot install here (its vendored archives are" \
       "missing: see prime_rl_dependencies.sh)" >&2
  exit 0
fi
# The client and the adapter's own distribution, into prime-rl's environment.
install_client "$PRIME_RL" ./adapters/primerl
WANDB_MODE=offline "$PRIME_RL/bin/python" -m pytest -q -p no:cacheprovider compat_tests/primerl/test_trainer_boundary.py \
  compat_tests/primerl/test_orchestrator.py "$@"
