#!/usr/bin/env bash
# `make bench-verl`: verl's phases through Arctic RL beside the backend's own calls (bench_phases.py), in
# verl's environment as `make compat` builds it. Arguments go to bench_phases.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
source compat_tests/verl/environment.sh
"$VENV/bin/python" compat_tests/verl/bench_phases.py "$@"
