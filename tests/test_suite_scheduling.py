"""How `make scenarios` deals its tests to two workers (`-n 2 --dist loadgroup`): the tests of one `xdist_group` run
on one worker, so one Ray cluster runs at a time and a module's servers start once. pytest 9.2 keeps node ids where
pytest-xdist 3.8 can no longer add the group to them, and the groups were then dealt test by test, silently
(constraints-cpu.txt pins a pytest that keeps them): run on a toy suite here, with the installed pair."""

import os
import subprocess
import sys
import textwrap

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("{group}")

@pytest.fixture(scope="module")
def servers():
    with open("starts.log", "a") as log:
        log.write("{group} %d\\n" % os.getpid())
    yield

@pytest.mark.parametrize("i", range(4))
def test_served(servers, i):
    with open("ran.log", "a") as log:
        log.write("{group} %d\\n" % os.getpid())
"""


def test_an_xdist_group_runs_on_one_worker_and_its_module_fixture_starts_once(tmp_path):
    for group in ("ray", "parity"):
        (tmp_path / f"test_{group}.py").write_text(textwrap.dedent(GROUPED.format(group=group)))
    (tmp_path / "test_loose.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(6))\n"
                                            "def test_loose(i):\n    pass\n")
    # The toy suite alone: neither this suite's ini options nor its environment's (a profiler's PYTEST_ADDOPTS).
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "-o", "addopts=", "."], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [line.split() for line in (tmp_path / "ran.log").read_text().splitlines()]
    assert len(ran) == 8
    for group in ("ray", "parity"):
        assert len({pid for name, pid in ran if name == group}) == 1, ran  # one worker each
    starts = (tmp_path / "starts.log").read_text().splitlines()
    assert sorted(line.split()[0] for line in starts) == ["parity", "ray"], starts  # each module's fixture once
