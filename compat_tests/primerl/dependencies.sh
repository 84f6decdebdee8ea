#!/usr/bin/env bash
# PrimeRL's two environments, each built once (a stamp marks it done): downloads and unpacking, nothing of Arctic
# RL's. Run from the repository root, by run.sh and by `make compat-dependencies` (which CI runs beside the suites).
# - The rollout side's: verifiers 0.4.0 and renderers 0.1.12 from the index.
# - prime-rl's own (prime_rl_dependencies.sh): prime-rl 0.8.0 from its vendored source, on Python 3.12. Where its
#   archives are not on the machine, only that environment is missing (run.sh says so).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/uv.sh
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/compat-primerl-venv
STAMP=$VENV/.installed-verifiers-0.4.0-renderers-0.1.12
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  uv_venv "$VENV" "$PYTHON" 24.3.1
  uv_pip "$VENV" "verifiers==0.4.0" "renderers==0.1.12" "pytest==9.2.0"
  touch "$STAMP"
fi
status=0
compat_tests/primerl/prime_rl_dependencies.sh || status=$?
[ "$status" = 0 ] || [ "$status" = 3 ] || exit "$status"
