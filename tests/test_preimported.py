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
        while preimported.alive(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not preimported.alive(sleeper.pid) and daemon.poll() is None
        assert second.run("platform", [], env=standalone_env(), timeout=60).stdout.strip() == platform.platform()
    finally:
        first.close()
        second.close()
        daemon.terminate()
        assert daemon.wait(30) == 0


def test_a_runs_processes_share_one_interpreter_per_environment_that_forks_only_for_its_own(tmp_path, monkeypatch):
    """A pytest run's (ARCTIC_RL_PREIMPORTED_RUN): a second process of the run, which differs by the worker's name
    and by what the imports set themselves, is served by the interpreter the first one started; a process whose
    environment would import otherwise is refused there and forks from an interpreter of its own. The run ends
    them, and an interpreter whose run has gone ends by itself."""
    for name in preimported.SHARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(preimported.RUN, str(tmp_path))
    monkeypatch.setenv(preimported.RUN_OWNER, str(os.getpid()))
    probe = ("tests.preimport_probe",)  # sets TORCHINDUCTOR_COMPILE_THREADS=1 as it is imported
    first, second = preimported.Preimported(probe), preimported.Preimported(probe)
    base = {k: v for k, v in standalone_env().items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    parent = ["-n1", "-r1", "import os; print(os.getppid())"]

    def parent_of_child(asker, **env) -> int:
        out = str(tmp_path / "out.log")
        assert asker.start("timeit", parent, env={**base, **env}, stdout=out, stderr=out).wait(60) == 0
        return int(open(out).read().split()[0])

    try:
        served_first = parent_of_child(first, PYTEST_XDIST_WORKER="gw0")
        [daemon] = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert served_first == daemon
        assert parent_of_child(second, PYTEST_XDIST_WORKER="gw1", TORCHINDUCTOR_COMPILE_THREADS="1") == daemon
        own = parent_of_child(second, PYTEST_XDIST_WORKER="gw1", TORCHINDUCTOR_COMPILE_THREADS="4")
        assert own != daemon and is_child_of_this_process(own)
        assert len(list(tmp_path.glob("*.pid"))) == 1
    finally:
        first.close()
        second.close()
    preimported.end_run()
    assert not tmp_path.exists() and ended(daemon)

    monkeypatch.setenv(preimported.RUN, str(tmp_path))
    owner = subprocess.Popen(["sleep", "600"])
    monkeypatch.setenv(preimported.RUN_OWNER, str(owner.pid))
    tmp_path.mkdir()
    asker = preimported.Preimported(probe)
    try:
        assert asker.run("platform", [], env=base, timeout=60).returncode == 0
        [daemon] = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        owner.kill()
        owner.wait()
        assert ended(daemon)
    finally:
        asker.close()
        preimported.end_run()


def ended(pid: int, timeout_s: float = 30) -> bool:
    """Gone, or a zombie (a run's interpreter is a child of the process that started it, which need not reap it),
    within `timeout_s`."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def is_child_of_this_process(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() == os.getpid()
    except psutil.NoSuchProcess:
        return False
