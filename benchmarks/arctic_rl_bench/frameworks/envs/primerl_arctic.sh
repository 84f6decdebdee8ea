#!/usr/bin/env bash
# `bench frameworks`, prime-rl through Arctic RL: prime-rl 0.8.0's own environment (compat_tests/primerl/
# prime_rl_dependencies.sh builds it from the vendored archives), the thin client and the adapter installed into it
# as a user installs them; prints its interpreter. Run from the repository root.
set -euo pipefail
VENV=.cache/compat-prime-rl-venv
compat_tests/primerl/prime_rl_dependencies.sh >&2
source compat_tests/client.sh
install_client "$VENV" ./adapters/primerl >&2
echo "$PWD/$VENV/bin/python"
