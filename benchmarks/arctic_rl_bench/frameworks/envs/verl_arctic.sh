#!/usr/bin/env bash
# `bench frameworks`, verl through Arctic RL: verl's compat environment (verl[verl-core] 0.9.1, the thin client
# and the adapter: compat_tests/verl/environment.sh builds it); prints its interpreter. Run from the repository root.
set -euo pipefail
source compat_tests/verl/environment.sh >&2
echo "$PWD/$VENV/bin/python"
