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
