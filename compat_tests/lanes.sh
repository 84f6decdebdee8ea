#!/usr/bin/env bash
# `make compat`: the frameworks' suites in lanes that run at once, each lane's suites in turn
# (`lanes.sh "verl" "primerl skyrl"`). A suite drives one server at a time from one test process and leaves
# about half of a 2-core machine idle (verl's ran at 50-65% busy), so two lanes take about the time of the
# longer one. Each lane writes its own log (.cache/compat-lane-<n>.log), printed whole once it ends; a suite
# that fails does not stop the others, and the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache

run_lane() {
  local status=0 suite
  for suite in "$@"; do
    echo "== compat: $suite"
    # CI's table (.ci/run) gets a row for each suite
    if ! ${CI_TIMES:+.ci/measure "$CI_TIMES" "  compat: $suite"} "compat_tests/$suite/run.sh"; then
      echo "== compat: $suite FAILED"
      status=1
    fi
  done
  return "$status"
}

# The servers the suites start run in the main environment, forked from one interpreter there that has imported the
# engines (tests/preimported.py), shared by every suite of both lanes: a suite's own would pay those imports again.
# (Its socket in a folder of the run's own under /tmp: a socket's path may not pass 107 bytes.) The client's and
# adapters' wheels are built once for the run there too (compat_tests/client.sh).
shared=$(mktemp -d)
export ARCTIC_RL_PREIMPORTED_SOCKET=$shared/preimported.sock ARCTIC_RL_PREIMPORTED_PYTHON=$PWD/.venv/bin/python
export ARCTIC_RL_WHEELS=$shared/wheels
mkdir "$ARCTIC_RL_WHEELS"
"$ARCTIC_RL_PREIMPORTED_PYTHON" -m tests.preimported --listen "$ARCTIC_RL_PREIMPORTED_SOCKET" \
  > .cache/compat-preimported.log 2>&1 &
preimported=$!
trap 'kill "$preimported" 2> /dev/null; wait "$preimported"; rm -rf "$shared"' EXIT

pids=()
for i in $(seq 1 $#); do
  # shellcheck disable=SC2086  # a lane is a space-separated list of suites
  run_lane ${!i} > ".cache/compat-lane-$i.log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in $(seq 1 $#); do
  wait "${pids[$((i - 1))]}" || failed=1
  cat ".cache/compat-lane-$i.log"
done
exit "$failed"
