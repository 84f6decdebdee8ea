"""Processes forked from an interpreter that has already imported torch, transformers, DeepSpeed and vLLM.

A scenario runs in a process of its own (one backend per process, as deployed), and a fresh interpreter pays those
imports each time: on a 2-core Zen 3 VM, 26 CPU s for a vLLM sampler's process that starts, closes and exits, of
which 7 are the later child's whole life when forked from one that imported them first. The suites start about 30
such processes, and servers and command lines of ours too: the compat suites' `arctic-rl serve`
(compat_tests/main_server.py) and the suites' `arctic-rl train`, `bench` and `eval` runs. So each test process
keeps, per Python and environment, one process that has imported them (`python -m tests.preimported`, started on
first use) and forks it for each such process: the child runs the module as `python -m` would, in its own session
and working directory, its output in files, counted in the cgroup of the test process that asked for it (CI's
table and .ci/per_test_cpu.py count by cgroup). Torch supports a fork after its import (its DataLoader workers are
forked), and nothing here initialises a device, a thread pool, a thread or a job before the fork. What still runs
in a fresh interpreter: the frameworks' processes, Ray's workers, and the tests of our command line's own start.

The test processes of one pytest run (xdist's workers) share them: the run's first process makes a folder for
them (ARCTIC_RL_PREIMPORTED_RUN; tests/conftest.py), the first to ask for an environment starts its interpreter
there, the others reach it by its socket, and the run ends them (a worker's own took 7 CPU s of imports). Such an
interpreter forks only for an environment that is its own but for the worker's name and for what its imports set
themselves (the same values: a test process that imported the libraries first carries them); it refuses any
other, and the asker forks from one of its own.

`make compat` starts one such interpreter for all its suites (`python -m tests.preimported --listen SOCKET`, named
to them by ARCTIC_RL_PREIMPORTED_SOCKET and _PYTHON): each child then takes the environment of the test process
that asked for it, but for what the libraries read at import (the daemon's own, lanes.sh's).

Protocol, one JSON line each way: a request `[id, module, args, stdout_path, stderr_path, cwd, env, cgroup]`; the
answers `{"id": id, "pid": N}` once the child runs and `{"id": id, "status": S}` (its exit status, or -signal) once
it has ended, or `{"id": id, "refused": why}`. Children run at once, each answered when it ends.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "transformers", "deepspeed", "vllm", "vllm.v1.engine.llm_engine", "arctic_rl_core.backend",
           "arctic_rl_core.engines.deepspeed_engine", "arctic_rl_core.samplers.vllm_sampler",
           "arctic_rl_core.server.run")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = "ARCTIC_RL_PREIMPORTED_SOCKET", "ARCTIC_RL_PREIMPORTED_PYTHON"
RUN, RUN_OWNER = "ARCTIC_RL_PREIMPORTED_RUN", "ARCTIC_RL_PREIMPORTED_RUN_OWNER"
WORKER_ONLY = {"PYTEST_XDIST_WORKER"}
"""What differs between a run's test processes and nothing reads at import."""
SET_BY_IMPORTS = {"TILELANG_CLEANUP_TEMP_FILES", "TRITON_CACHE_AUTOTUNING", "AITER_SITUV2_A4W4", "LD_LIBRARY_PATH",
                  "TORCHINDUCTOR_CACHE_DIR", "RAY_CLIENT_MODE", "TORCHINDUCTOR_COMPILE_THREADS",
                  "PYTORCH_NVML_BASED_CUDA_CHECK"}
"""What importing PRELOAD set in os.environ (torch 2.13, vLLM 0.32, Ray 2.60, OpenCV's loader): left out of the name of
a run's interpreter, so that a test process that has imported them finds the one of its environment before. Only a
hint: the interpreter checks what its own imports set. (Not DS_ACCELERATOR, which our engines set before DeepSpeed's
import, and so a process that made one: such processes share another interpreter.)"""
CGROUP_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


class Refused(Exception):
    """A run's interpreter does not fork for this environment: it imported in another."""


class Child:
    """A process the preimported interpreter forked, with what `subprocess.Popen` offers of one: it is that
    interpreter's child, not this process's, so its status comes as that interpreter's answer."""

    def __init__(self, pid: int, ended: threading.Event, answer: dict):
        self.pid, self._ended, self._answer = pid, ended, answer

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        if not self._ended.is_set():
            return None
        if "status" not in self._answer:
            raise RuntimeError("the preimported interpreter ended before its child (its output is the test's)")
        return self._answer["status"]

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"preimported child {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if not self._ended.is_set():  # once it has ended, its pid may be another process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """The child's whole session: it leads it, and what it started goes with it."""
        if not self._ended.is_set():
            _kill_session(self.pid)


class Interpreter:
    """A preimported interpreter: `python -m tests.preimported` in `env`, or the shared one at `shared` (a socket);
    forks a child per `start`, many at once."""

    def __init__(self, python: str, env: dict, shared: str | None = None, modules: tuple[str, ...] = PRELOAD):
        self.process = None
        if shared is None:
            self.process = subprocess.Popen([python, "-m", "tests.preimported", "--modules", ",".join(modules)],
                                            cwd=ROOT, env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._requests, answers = self.process.stdin, self.process.stdout
        else:
            self._socket = _connected(shared)
            self._requests, answers = self._socket.makefile("w"), self._socket.makefile("r")
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, threading.Event, dict]] = {}
        self._lock = threading.Lock()
        self._gone = threading.Event()
        threading.Thread(target=self._read_answers, args=(answers,), daemon=True).start()

    def start(self, module: str, args: list[str], stdout_path: str, stderr_path: str, cwd: str | None,
              env: dict) -> Child:
        started, ended, answer = threading.Event(), threading.Event(), {}
        request = [module, args, stdout_path, stderr_path, cwd, env, _own_cgroup()]
        with self._lock:
            if self._gone.is_set():
                raise RuntimeError("the preimported interpreter has ended (its output is the test's)")
            number = next(self._ids)
            self._waiting[number] = started, ended, answer
            self._requests.write(json.dumps([number, *request]) + "\n")
            self._requests.flush()
        started.wait()
        if "refused" in answer:
            raise Refused(answer["refused"])
        if "pid" not in answer:
            raise RuntimeError("the preimported interpreter ended without answering (its output is the test's)")
        return Child(answer["pid"], ended, answer)

    def usable(self) -> bool:
        return not self._gone.is_set()

    def running(self) -> bool:
        with self._lock:
            return any(not ended.is_set() for _, ended, _ in self._waiting.values())

    def _read_answers(self, answers) -> None:
        for line in answers:
            answer = json.loads(line)
            with self._lock:
                started, ended, box = self._waiting[answer["id"]]
            if "pid" in answer:
                box["pid"] = answer["pid"]
                started.set()
            elif "refused" in answer:
                box["refused"] = answer["refused"]
                with self._lock:
                    del self._waiting[answer["id"]]
                started.set()
                ended.set()
            else:
                box["status"] = answer["status"]
                with self._lock:
                    del self._waiting[answer["id"]]
                ended.set()
        with self._lock:  # it ended: nothing more will be answered
            self._gone.set()
            for started, ended, _ in self._waiting.values():
                started.set()
                ended.set()

    def close(self) -> None:
        """Ends any child still running; then the interpreter, where it is this process's own."""
        with self._lock:
            pids = [box["pid"] for _, ended, box in self._waiting.values() if "pid" in box and not ended.is_set()]
        for pid in pids:
            _kill_session(pid)
        self._requests.close()  # an interpreter of its own ends when its input does, once its children have
        if self.process is None:
            self._socket.shutdown(socket.SHUT_RDWR)  # the reader's file holds it open otherwise
            self._socket.close()
            return
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Preimported:
    """This process's preimported interpreters, one per Python and environment, or the shared one: each started
    or reached on first use, left with this process. `modules`: what those it starts import."""

    def __init__(self, modules: tuple[str, ...] = PRELOAD):
        self.modules = modules
        self._interpreters: dict[tuple, Interpreter] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def start(self, module: str, args: list[str], *, env: dict, stdout: str, stderr: str, cwd: str | None = None,
              python: str = sys.executable) -> Child:
        """`python -m module args...` as a child of the preimported interpreter, its output written to the files
        `stdout` and `stderr` (the same path: both into one)."""
        env = {key: value for key, value in env.items() if key != "PYTEST_CURRENT_TEST"}  # the test's name changes
        try:
            return self._interpreter(python, env).start(module, list(args), stdout, stderr, cwd, env)
        except Refused:
            return self._interpreter(python, env, of_the_run=False).start(module, list(args), stdout, stderr, cwd, env)

    def run(self, module: str, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """`python -m module args...` to its end: its status and output, as `subprocess.run(...,
        capture_output=True, text=True)` gives them. Past `timeout` s its whole session is killed and
        subprocess.TimeoutExpired raised."""
        with tempfile.TemporaryDirectory() as out:
            paths = [os.path.join(out, "stdout"), os.path.join(out, "stderr")]
            child = self.start(module, args, env=env, stdout=paths[0], stderr=paths[1])
            try:
                status = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                stdout, stderr = (open(path).read() for path in paths)
                raise subprocess.TimeoutExpired([module, *args], timeout, stdout, stderr) from None
            stdout, stderr = (open(path).read() for path in paths)
            return subprocess.CompletedProcess([module, *args], status, stdout, stderr)

    def _interpreter(self, python: str, env: dict, of_the_run: bool = True) -> Interpreter:
        shared, shared_python = (os.environ.get(name) for name in SHARED)
        if shared and shared_python and os.path.abspath(python) == os.path.abspath(shared_python):
            key = ("shared", shared)
        elif of_the_run and os.environ.get(RUN):
            shared = _run_interpreter(os.environ[RUN], python, env, self.modules)
            key = ("shared", shared)
        else:
            shared, key = None, (python, tuple(sorted(env.items())))
        with self._lock:
            interpreter = self._interpreters.get(key)
            if interpreter is not None and not interpreter.usable():
                interpreter = None
            if interpreter is None:
                # Another environment's interpreter is ended once nothing of it runs: one is kept per environment in
                # use, not one per environment ever asked for (each holds the libraries' memory).
                for other_key, other in list(self._interpreters.items()):
                    if other_key[0] == python and not other.running():
                        other.close()
                        del self._interpreters[other_key]
                interpreter = self._interpreters[key] = Interpreter(python, env, shared, self.modules)
            return interpreter

    def close(self) -> None:
        with self._lock:
            for interpreter in self._interpreters.values():
                interpreter.close()
            self._interpreters.clear()


def share_within_run() -> None:
    """This pytest run's processes (this one and the workers it starts) share their interpreters."""
    os.environ[RUN] = tempfile.mkdtemp(prefix="arctic-rl-preimported-")
    os.environ[RUN_OWNER] = str(os.getpid())


def end_run() -> None:
    """Ends the run's interpreters (what they still run goes with them) and removes their folder."""
    folder = os.environ.pop(RUN, None)
    os.environ.pop(RUN_OWNER, None)
    if folder is None:
        return
    for name in os.listdir(folder):
        if name.endswith(".pid"):
            with open(os.path.join(folder, name)) as f:
                _kill_session(int(f.read()))
    shutil.rmtree(folder, ignore_errors=True)


def _run_interpreter(folder: str, python: str, env: dict, modules: tuple[str, ...]) -> str:
    """The socket of the run's interpreter for `python`, `env` and `modules`, which this process starts if none
    has."""
    named_by = sorted((key, value) for key, value in env.items() if key not in WORKER_ONLY | SET_BY_IMPORTS)
    name = hashlib.sha256(json.dumps([os.path.abspath(python), modules, named_by]).encode()).hexdigest()[:16]
    path = os.path.join(folder, name)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # until the file closes
        if not os.path.exists(path + ".pid"):
            with open(path + ".log", "w") as log:
                daemon = subprocess.Popen([python, "-m", "tests.preimported", "--listen", path + ".sock",
                                           "--modules", ",".join(modules),
                                           "--run-owner", os.environ.get(RUN_OWNER, str(os.getpid()))],
                                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            with open(path + ".pid", "w") as f:
                f.write(str(daemon.pid))
    return path + ".sock"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _connected(path: str, timeout_s: float = 60) -> socket.socket:
    """A connection to the shared interpreter, which binds its socket before its imports (lanes.sh starts it just
    before the suites)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _own_cgroup() -> str | None:
    """This process's cgroup (v2), where its children are to be counted."""
    try:
        with open("/proc/self/cgroup") as f:
            return next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None


def _kill_session(pid: int) -> None:
    """The child leads its session: what it started goes with it. (A child that has not called setsid yet leads
    no group: itself, then.)"""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_here = Preimported()


def run(module: str, *args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return _here.run(module, list(args), env, timeout)


def start(module: str, *args: str, env: dict, stdout: str, stderr: str, cwd: str | None = None,
          python: str = sys.executable) -> Child:
    return _here.start(module, list(args), env=env, stdout=stdout, stderr=stderr, cwd=cwd, python=python)


def arctic_rl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`arctic-rl ARGS` (`python -m arctic_rl_core.cli`), forked, as a world of its own (not our rendezvous)."""
    from arctic_rl_core.engines.distributed import standalone_env

    return run("arctic_rl_core.cli", *args, env=standalone_env(), timeout=timeout)


def _child(module: str, args: list[str], stdout_path: str, stderr_path: str, cwd: str | None, env: dict,
           cgroup: str | None) -> None:
    """In the forked child: the module as `python -m module args...` runs it, then the process ends."""
    import runpy
    import traceback

    os.setsid()
    if cgroup not in (None, "/"):  # the asking process's cgroup, where one is set (the root holds everything)
        for root in CGROUP_ROOTS:
            try:
                with open(f"{root}{cgroup}/cgroup.procs", "w") as procs:
                    procs.write("0")  # this process
                break
            except OSError:
                continue
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, (path, flags) in enumerate(((os.devnull, os.O_RDONLY), (stdout_path, written), (stderr_path, written))):
        if fd == 2 and path == stdout_path:
            os.dup2(1, 2)  # one file, one offset: the two streams interleave as a pipe would
            continue
        opened = os.open(path, flags, 0o600)
        if opened != fd:  # (the descriptor may be free, the askers' closed: the file then opens on it)
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


class _Connection:
    """One asker: its requests read off `fd`, its answers written to `answers`."""

    def __init__(self, fd: int, answers, closing=None):
        self.fd, self.answers, self.pending, self.closing = fd, answers, b"", closing

    def close_in_child(self) -> None:
        """A forked child keeps none of the askers' connections open (an asker sees its end by their closing)."""
        self.answers.close()
        os.close(self.closing.detach() if self.closing is not None else self.fd)

    def close(self) -> None:
        try:
            self.answers.close()
        except OSError:  # a pipe its reader has closed
            pass
        if self.closing is not None:
            self.closing.close()

    def answer(self, **fields) -> None:
        if self.answers.closed:  # the asker has gone; its children were ended
            return
        try:
            self.answers.write(json.dumps(fields) + "\n")
            self.answers.flush()
        except OSError:  # it is going
            pass


def serve(listen: str | None = None, modules: tuple[str, ...] = PRELOAD, run_owner: int | None = None) -> None:
    """Answer the process that started this one on its standard input and output; with `listen`, any process that
    connects to the socket at that path, until ended by a signal. `modules`: those imported before any fork.
    `run_owner`: a pytest run's interpreter (with `listen`), which forks only for its own environment and ends
    once that process has gone (a run that ended without ending it)."""
    import importlib

    from arctic_rl_core.process_exit import exit_now

    listener = None
    if listen is not None:  # bound before the imports: askers connect at once, and their requests wait for them
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(listen)
        listener.listen()
        signal.signal(signal.SIGTERM, lambda *_: exit_now(0))
    # Answers go out on a descriptor of their own: what the imports log to standard output goes to standard error.
    connections = {} if listener else {0: _Connection(0, os.fdopen(os.dup(1), "w"))}
    os.dup2(2, 1)
    imported_in = dict(os.environ)
    for name in modules:
        importlib.import_module(name)
    set_by_imports = {key for key in set(os.environ) | set(imported_in) if os.environ.get(key) != imported_in.get(key)}

    def refusal(env: dict) -> str | None:
        """Why a child in `env` would not be the one a fresh interpreter runs, if so."""
        if run_owner is None:
            return None
        differing = {key for key in (set(env) | set(imported_in)) - WORKER_ONLY if env.get(key) != imported_in.get(key)
                     and not (key in set_by_imports and env.get(key) == os.environ.get(key))}
        return f"imported in another environment: {sorted(differing)}" if differing else None

    # One thread: requests, connections and children's ends are all waited for here (a thread beside a fork could
    # hold a lock that the child then inherits held).
    running: dict[int, tuple[_Connection, int]] = {}  # pid -> (asker, request id)
    while connections or running or listener:
        watched = list(connections) + ([listener.fileno()] if listener else [])
        readable = select.select(watched, [], [], 0.1 if running else 1 if run_owner else None)[0] if watched else []
        if run_owner is not None and not running and not alive(run_owner):
            break
        if not watched:
            pid, status = os.waitpid(-1, 0)
            asker, request = running.pop(pid)
            asker.answer(id=request, status=os.waitstatus_to_exitcode(status))
        for fd in readable:
            if listener and fd == listener.fileno():
                connection, _ = listener.accept()
                connections[connection.fileno()] = _Connection(connection.fileno(), connection.makefile("w"),
                                                               connection)
                continue
            asker = connections[fd]
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the asker has gone: what it started goes with it
                del connections[fd]
                for pid, (owner, _) in running.items():
                    if owner is asker:
                        _kill_session(pid)
                asker.close()
                continue
            asker.pending += chunk
            while b"\n" in asker.pending:
                line, asker.pending = asker.pending.split(b"\n", 1)
                request, module, args, stdout_path, stderr_path, cwd, env, cgroup = json.loads(line)
                refused = refusal(env)
                if refused:
                    asker.answer(id=request, refused=refused)
                    continue
                sys.stdout.flush()  # what the imports left in the streams' buffers is not the child's output
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the child ends on one as `python -m` would
                    if listener:
                        listener.close()
                    for other in connections.values():
                        other.close_in_child()
                    _child(module, args, stdout_path, stderr_path, cwd, env, cgroup)
                running[pid] = asker, request
                asker.answer(id=request, pid=pid)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            asker, request = running.pop(pid)
            asker.answer(id=request, status=os.waitstatus_to_exitcode(status))
    exit_now(0)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.preimported")
    parser.add_argument("--listen", metavar="SOCKET", help="serve any process that connects here (make compat)")
    parser.add_argument("--modules", type=lambda names: tuple(filter(None, names.split(","))), default=PRELOAD,
                        help="the modules to import first, comma-separated (default: the engines')")
    parser.add_argument("--run-owner", type=int, metavar="PID",
                        help="with --listen: a pytest run's, for its own environment only, until PID has gone")
    options = parser.parse_args()
    serve(options.listen, options.modules, options.run_owner)
