"""The suites' preimported interpreter (tests/preimported.py): a child runs its module as `python -m` runs it, with its
status and output, and one past its timeout is killed without taking the next one with it."""

import platform
import subprocess

import pytest

from arctic_rl_core.engines.distributed import standalone_env
from tests import preimported


def test_a_preimported_child_runs_its_module_as_python_m_does_and_is_killed_past_its_timeout():
    env = standalone_env()
    shown = preimported.run("platform", env=env, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == platform.platform()
    failed = preimported.run("json.tool", "/nonexistent.json", env=env, timeout=60)
    assert failed.returncode != 0 and "nonexistent.json" in failed.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        preimported.run("timeit", "-n1", "-r1", "import time; time.sleep(600)", env=env, timeout=2)
    assert preimported.run("platform", env=env, timeout=60).returncode == 0  # and the next one runs
