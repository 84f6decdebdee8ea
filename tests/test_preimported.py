"""The suites' preimported interpreter (tests/preimported.py): a child runs its module as `python -m` runs it, with its
status and output, and one past its timeout is killed without taking the next one with it."""

import os
import platform
import signal
import subprocess
import sys
import time

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


def test_preimported_children_run_at_once_each_in_its_folder_and_end_on_a_signal(tmp_path):
    """What servers need of it (compat_tests/main_server.py): a child that runs until stopped, others started and
    ended beside it, a working directory of its own, both streams in one log, and the signals Popen sends."""
    env = standalone_env()
    log = str(tmp_path / "sleeper.log")
    sleeper = preimported.start("timeit", "-n1", "-r1", "import time; time.sleep(600)", env=env, stdout=log,
                                stderr=log)
    assert sleeper.poll() is None and sleeper.returncode is None
    (tmp_path / "data.json").write_text('{"here": 1}')
    out = str(tmp_path / "out.log")
    shown = preimported.start("json.tool", "data.json", env=env, stdout=out, stderr=out, cwd=str(tmp_path))
    assert shown.wait(60) == 0 and '"here": 1' in open(out).read()  # read from its own folder, while the other runs
    missing = preimported.start("json.tool", "missing.json", env=env, stdout=out, stderr=out, cwd=str(tmp_path))
    assert missing.wait(60) != 0 and "missing.json" in open(out).read()  # its standard error, in the same file
    assert sleeper.poll() is None
    sleeper.terminate()
    assert sleeper.wait(60) == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        preimported.start("timeit", "-n1", "-r1", "import time; time.sleep(600)", env=env, stdout=log,
                          stderr=log).wait(0.5)


def test_one_shared_interpreter_serves_each_asker_in_its_own_environment_and_outlives_them(tmp_path, monkeypatch):
    """`make compat`'s (`--listen`): test processes that each reach it by ARCTIC_RL_PREIMPORTED_SOCKET, a child in
    the environment of the one that asked for it, and what an asker started ended with it when it goes."""
    sock = str(tmp_path / "preimported.sock")
    daemon = subprocess.Popen([sys.executable, "-m", "tests.preimported", "--listen", sock, "--modules", "json"],
                              cwd=preimported.ROOT, env=standalone_env())
    monkeypatch.setenv("ARCTIC_RL_PREIMPORTED_SOCKET", sock)
    monkeypatch.setenv("ARCTIC_RL_PREIMPORTED_PYTHON", sys.executable)
    first, second = preimported.Preimported(), preimported.Preimported()
    try:
        shown = {}
        for name, asker in (("first", first), ("second", second)):
            out = str(tmp_path / f"{name}.log")
            env = {**standalone_env(), "ASKER": name}
            child = asker.start("timeit", ["-n1", "-r1", "import os; print(os.environ['ASKER'])"], env=env,
                                stdout=out, stderr=out)
            assert child.wait(60) == 0
            shown[name] = open(out).read().split()[0]
            assert not is_child_of_this_process(child.pid)  # the daemon's child, reaped by it
        assert shown == {"first": "first", "second": "second"}
        log = str(tmp_path / "sleeper.log")
        sleeper = first.start("timeit", ["-n1", "-r1", "import time; time.sleep(600)"], env=standalone_env(),
                              stdout=log, stderr=log)
        first.close()  # the first asker leaves: its sleeper is ended, the daemon serves on
        deadline = time.monotonic() + 60
        while pid_alive(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(sleeper.pid) and daemon.poll() is None
        assert second.run("platform", [], env=standalone_env(), timeout=60).stdout.strip() == platform.platform()
    finally:
        first.close()
        second.close()
        daemon.terminate()
        assert daemon.wait(30) == 0


def is_child_of_this_process(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
