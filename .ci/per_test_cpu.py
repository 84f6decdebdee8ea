"""CPU seconds per test, every process a test starts counted: where a suite's time goes, before cutting any.

    PYTHONPATH=$PWD/.ci PYTEST_ADDOPTS="-p per_test_cpu" PER_TEST_CPU=/tmp/cpu.tsv make test   # or scenarios, compat
    python .ci/per_test_cpu.py /tmp/cpu.tsv [N]     # per file, then the N costliest tests

Before each test its pytest process moves into a cgroup (v2) of its own, so whatever it starts (servers, Ray's
daemons and actors, engine cores, framework runs) is counted there, those that outlive the test included. A module
fixture's processes count in the first test that used them, and so do the processes that a pytest process's
preimported interpreter forks for later tests (tests/preimported.py: scenarios, servers, command lines). Needs a
writable cgroup v2 mount (root on CI's VMs; PER_TEST_CPU_ROOT, default /sys/fs/cgroup/unified or /sys/fs/cgroup).
Read the report once the run has ended.
"""

from __future__ import annotations

import collections
import os
import sys
import time


def _root() -> str:
    if "PER_TEST_CPU_ROOT" in os.environ:
        return os.environ["PER_TEST_CPU_ROOT"]
    return next(r for r in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup") if os.path.exists(f"{r}/cgroup.controllers"))


try:
    import pytest
except ImportError:  # the report needs nothing but the standard library
    pytest = None

if pytest is not None:
    _tests = [0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _tests[0] += 1
        group = os.path.join(_root(), "per-test-cpu", f"{os.getpid()}-{_tests[0]}")
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        start = time.monotonic()
        yield
        with open(os.environ.get("PER_TEST_CPU", "per-test-cpu.tsv"), "a") as out:
            out.write(f"{group}\t{item.nodeid}\t{time.monotonic() - start:.1f}\n")


def report(path: str, top: int) -> None:
    rows = []
    for line in open(path):
        group, test, wall = line.rstrip("\n").split("\t")
        with open(os.path.join(group, "cpu.stat")) as stat:
            usec = next(int(row.split()[1]) for row in stat if row.startswith("usage_usec"))
        rows.append((test, float(wall), usec / 1e6))
    files = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for test, wall, cpu in rows:
        entry = files[test.split("::")[0]]
        entry[0] += 1
        entry[1] += wall
        entry[2] += cpu
    print(f"{len(rows)} tests, {sum(r[1] for r in rows):.0f} s, {sum(r[2] for r in rows):.0f} CPU s")
    print(f"{'CPU s':>8} {'wall s':>8} {'tests':>5}  file")
    for name, (count, wall, cpu) in sorted(files.items(), key=lambda item: -item[1][2]):
        print(f"{cpu:8.1f} {wall:8.1f} {count:5d}  {name}")
    for test, wall, cpu in sorted(rows, key=lambda r: -r[2])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f}        {test}")


if __name__ == "__main__":
    report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
