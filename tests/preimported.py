"""Test processes forked from an interpreter that has already imported torch, transformers, DeepSpeed and vLLM.

A scenario runs in a process of its own (one backend per process, as deployed), and a fresh interpreter pays those
imports each time: on a 2-core Zen 3 VM, 26 CPU s for a vLLM sampler's process that starts, closes and exits, of
which 7 are the later child's whole life when forked from one that imported them first. The suites start about 30
such processes. So each pytest worker keeps one process that has imported them (`python -m tests.preimported`,
started on first use with the environment `run` is given) and forks it once per scenario: the child runs the
module as `python -m` would, in its own session, its output in files. Torch supports a fork after its import
(its DataLoader workers are forked), and nothing here initialises a device, a thread pool or a job before the
fork. What still runs in a fresh interpreter: every server, command line and framework process the suites start.

Protocol, one JSON line each way: a request `[module, args, stdout_path, stderr_path]`; the answers
`{"pid": N}` once the child runs and `{"status": S}` (its exit status, or -signal) once it has ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

PRELOAD = ("torch", "transformers", "deepspeed", "vllm", "vllm.v1.engine.llm_engine", "arctic_rl_core.backend",
           "arctic_rl_core.engines.deepspeed_engine", "arctic_rl_core.samplers.vllm_sampler")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Preimported:
    """This process's preimported interpreter: started on first use, ended with this process."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._env: dict | None = None
        self._lock = threading.Lock()

    def run(self, module: str, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """`python -m module args...` as a child of the preimported interpreter; its status and output, as
        `subprocess.run(..., capture_output=True, text=True)` gives them. Past `timeout` s its whole session is killed
        and subprocess.TimeoutExpired raised."""
        with self._lock, tempfile.TemporaryDirectory() as out:
            process = self._started(env)
            paths = [os.path.join(out, "stdout"), os.path.join(out, "stderr")]
            process.stdin.write(json.dumps([module, list(args), *paths]) + "\n")
            process.stdin.flush()
            pid = self._answer(process)["pid"]
            killed = threading.Event()
            timer = threading.Timer(timeout, lambda: (killed.set(), _kill_session(pid)))
            timer.start()
            try:
                status = self._answer(process)["status"]
            finally:
                timer.cancel()
            stdout, stderr = (open(path).read() for path in paths)
            if killed.is_set():
                raise subprocess.TimeoutExpired([module, *args], timeout, stdout, stderr)
            return subprocess.CompletedProcess([module, *args], status, stdout, stderr)

    def _started(self, env: dict) -> subprocess.Popen:
        env = {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}  # the test's name changes
        if self._process is not None and (self._process.poll() is not None or self._env != env):
            self.close()
        if self._process is None:
            self._process = subprocess.Popen([sys.executable, "-m", "tests.preimported"], cwd=ROOT, env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._env = env
        return self._process

    def _answer(self, process: subprocess.Popen) -> dict:
        line = process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the preimported interpreter ended without answering (its output is the test's)")
        return json.loads(line)

    def close(self) -> None:
        if self._process is not None:
            self._process.stdin.close()  # it ends when its input does
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its session: what it started goes with it
    except ProcessLookupError:
        pass


_here = Preimported()


def run(module: str, *args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return _here.run(module, list(args), env, timeout)


def _child(module: str, args: list[str], stdout_path: str, stderr_path: str) -> None:
    """In the forked child: the module as `python -m module args...` runs it, then the process ends."""
    import runpy
    import traceback

    os.setsid()
    for fd, (path, flags) in enumerate(((os.devnull, os.O_RDONLY), (stdout_path, os.O_WRONLY | os.O_CREAT),
                                        (stderr_path, os.O_WRONLY | os.O_CREAT))):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [module, *args]
    status = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:  # as the interpreter ends on one
        if end.code is None or isinstance(end.code, int):
            status = end.code or 0
        else:
            print(end.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - reported as `python -m` reports it, then the status says it failed
        traceback.print_exc()
        status = 1
    from arctic_rl_core.process_exit import exit_now

    exit_now(status)


def serve() -> None:
    import importlib

    from arctic_rl_core.process_exit import exit_now

    # Answers go out on a descriptor of their own: what the imports log to standard output goes to standard error.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        module, args, stdout_path, stderr_path = json.loads(line)
        sys.stdout.flush()  # what the imports left in the streams' buffers is not the child's output
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(module, args, stdout_path, stderr_path)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()
    exit_now(0)


if __name__ == "__main__":
    serve()
