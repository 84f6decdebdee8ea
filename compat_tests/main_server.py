"""`arctic-rl serve` in the main environment (where the engines are), for compat tests that run in a
framework's own environment. Both sides load the tiny model from the same folder."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx

MAIN_PYTHON = os.environ.get("ARCTIC_RL_MAIN_PYTHON", os.path.join(os.getcwd(), ".venv", "bin", "python"))
# A framework's launcher may leave a torch.distributed rendezvous in the environment; the server is its own world.
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}


ROOT = Path(__file__).resolve().parent.parent
BUILT_MODELS = ROOT / ".cache" / "compat-tiny-models"
"""Each tiny model the suites ask for, built once per checkout and builder (`make-tiny-model`'s arguments and
arctic_rl_core/models/tiny.py): several suites and both lanes ask for the same ones, each build a new interpreter
importing torch and transformers (about 3 CPU s)."""


def make_tiny_model(path: str, *args: str) -> str:
    """`arctic-rl make-tiny-model ARGS PATH`: a copy of the one built for these arguments, built if none is."""
    builder = ROOT / "arctic_rl_core" / "models" / "tiny.py"
    key = hashlib.sha256(json.dumps([args, builder.read_text()]).encode()).hexdigest()[:16]
    built = BUILT_MODELS / key
    if not built.is_dir():
        BUILT_MODELS.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=BUILT_MODELS))
        subprocess.run([MAIN_PYTHON, "-m", "arctic_rl_core.cli", "make-tiny-model", *args, str(building / "model")],
                       check=True, capture_output=True, env=main_env())
        try:
            (building / "model").rename(built)
        except OSError:  # the other lane built it meanwhile: the same model
            pass
        shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(built, path)
    return path


@functools.cache
def _preimported():
    """tests/preimported.py, loaded by its path: a framework's environment may hold a `tests` package of its own
    (verl's does)."""
    spec = importlib.util.spec_from_file_location("arctic_rl_preimported", ROOT / "tests" / "preimported.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def serving(job: dict, work: Path, *args: str, start_timeout_s: float = 300, env: dict[str, str] | None = None,
            on_loaded: Callable[[subprocess.Popen], None] | None = None, fresh: bool = False):
    """The server's URL once it has loaded `job` (a BackendConfig); its log is `work/server.log`. `env`: variables
    for the server beside this process's; `on_loaded`: called with the server's process once the job is loaded.
    The server is forked from an interpreter of the main environment that has imported the engines already
    (tests/preimported.py: the suites start a dozen servers, each about 15 CPU s of imports in a fresh one);
    `fresh`: in a fresh interpreter, as a user starts it (the benches)."""
    (work / "job.yaml").write_text(json.dumps(job))
    port = free_port()
    command = ["serve", "--port", str(port), "--config", str(work / "job.yaml"), *args]
    server_env, log = {**main_env(), **(env or {})}, work / "server.log"
    if fresh:
        with open(log, "w") as out:
            proc = subprocess.Popen([MAIN_PYTHON, "-m", "arctic_rl_core.cli", *command], stdout=out,
                                    stderr=subprocess.STDOUT, cwd=work, env=server_env)
    else:
        proc = _preimported().start("arctic_rl_core.cli", *command, env=server_env, stdout=str(log),
                                    stderr=str(log), cwd=str(work), python=MAIN_PYTHON)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + start_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"arctic-rl serve exited ({proc.returncode}); see {log}")
            try:
                if httpx.get(f"{url}/v1/status", timeout=2).json().get("initialized"):
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"arctic-rl serve did not load its job in time; see {log}")
            time.sleep(1)
        if on_loaded is not None:
            on_loaded(proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tiny_qwen3(folder: Path) -> str:
    """A tiny random Qwen3 (with its ChatML template and a local tokenizer) in `folder`."""
    return make_tiny_model(str(folder / "tiny-qwen3"), "--family", "qwen3", "--max-positions", "1024")


@contextmanager
def serving_light(model: str, work: Path, engine: dict, *args: str, reference: bool = False, critic: bool = False):
    """`serving` a job on `model` with DeepSpeed and the transformers sampler (the quickest to start), its
    checkpoints under `work/checkpoints`; with `reference`, a reference model of the initial weights; with `critic`,
    a critic on the same decoder."""
    job = {"model_path": model, "sampler": {"name": "transformers"}, "engine": engine, "reference": {"enable": reference},
           "critic": {"enable": critic}}
    with serving(job, work, "--checkpoint-dir", str(work / "checkpoints"), *args) as url:
        yield url
