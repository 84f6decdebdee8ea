#!/usr/bin/env bash
# `bench frameworks`, SkyRL through Arctic RL: SkyRL's compat environment (skyrl 0.4.0 on Python 3.12, the thin
# client and the adapter: compat_tests/skyrl/environment.sh builds it); prints its interpreter. From the repository root.
set -euo pipefail
source compat_tests/skyrl/environment.sh >&2
echo "$PWD/$VENV/bin/python"
