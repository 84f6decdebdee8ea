"""prime-rl's own orchestrator trains through Arctic RL: its console scripts and stock code, end to end.

Four processes, as a user runs them (docs/primerl.md): `arctic-rl serve` (main environment) with a job on the tiny
Qwen3, prime-rl's `env-server` serving the `arctic_letters` taskset (this folder, on PYTHONPATH), prime-rl's
`orchestrator` sampling from the server's token route and sending batches on its transport, and
`arctic-rl-primerl-trainer` training them through the server and publishing `broadcasts/step_n/STABLE`, which the
orchestrator's weight watcher turns into `/update_weights`. Runs in prime-rl's environment (run.sh).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compat_tests.main_server import free_port, serving

STEPS = 6
LEARNING_STEPS = 10
"""The runs that check the reward rises. It rises about 0.05 a step from the fourth (runs in docs/benchmarks.md) and
one step's mean over 32 samples moves by about 0.08, so six steps left a run beside CI's other lane flat: ten give
the last three steps a margin of several standard deviations over the first three."""
LEARNING_RATE = 2e-2
"""High for the tiny model, so that the letters' share rises within those steps."""
RUN_TIMEOUT_S = 600
BIN = Path(sys.executable).parent


def _configs(work: Path, model: str, url: str, transport: str, replay: bool, steps: int) -> dict[str, Path]:
    """The three TOMLs: the env server's, the orchestrator's (no [trainer], no [inference]) and the trainer's."""
    out, env_address = work / "run", f"tcp://127.0.0.1:{free_port()}"
    shared = (f'output_dir = "{out}"\nmax_steps = {steps}\n[model]\nname = "{model}"\n'
              f'[rollout_transport]\ntype = "{transport}"\n' + (f"port = {free_port()}\n" if transport == "zmq" else ""))
    env = '[env.taskset]\nid = "arctic_letters"\n[env.agent.runtime]\ntype = "subprocess"\n'
    texts = {
        "env": f'output_dir = "{out}"\n{env}[serve]\naddress = "{env_address}"\n[serve.pool]\ntype = "static"\n'
               "num_workers = 1\n",
        # At most one step off-policy and one batch in flight: step n's reward then measures the policy of step
        # n-1 or n-2 on any machine. Under prime-rl's defaults (8 steps; the 128 episodes our KV cache admits, all
        # dispatched under v0) batches trained on rollouts up to 3 versions old here, and on CI's machine the
        # reward stayed flat over the six steps. Measured with these bounds: 0.40 -> 0.71, 0.41 -> 0.71.
        "orchestrator": ("seq_len = 512\nbatch_size = 32\ngroup_size = 8\nnum_train_workers = 1\n"
                         "max_off_policy_steps = 1\n"
                         f"collect_inference_metrics = false\n{shared}[model.client]\nbase_url = \"{url}/v1\"\n"
                         '[renderer]\nname = "qwen3"\n[train.sampling]\nmax_completion_tokens = 16\n'
                         '[[train.source]]\nname = "letters"\n' + env.replace("[env.", "[train.source.env.")
                         + f'[train.source.serve]\naddress = "{env_address}"\n[weight_broadcast]\ntype = "filesystem"\n'
                         "[concurrency]\nmax_inflight = 32\n"),
        "trainer": ("enable_router_replay = true\n" if replay else "") + f"{shared}[optim]\nlr = {LEARNING_RATE}\n",
    }
    paths = {}
    for name, text in texts.items():
        paths[name] = work / f"{name}.toml"
        paths[name].write_text(text)
    return paths


def _run(work: Path, model: str, url: str, transport: str, steps: int, replay: bool = False) -> dict[str, int]:
    """The env server, the orchestrator and the trainer until the last two end; each one's exit code."""
    configs = _configs(work, model, url, transport, replay, steps)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.getcwd()])}
    commands = {"env": [BIN / "env-server", "@", configs["env"]],
                "orchestrator": [BIN / "orchestrator", "@", configs["orchestrator"]],
                "trainer": [BIN / "arctic-rl-primerl-trainer", "--arctic-rl-url", url, "@", configs["trainer"]]}
    procs = {name: subprocess.Popen(command, env=env, stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT)
             for name, command in commands.items()}
    deadline = time.time() + RUN_TIMEOUT_S
    try:
        while time.time() < deadline and any(procs[n].poll() is None for n in ("orchestrator", "trainer")):
            if any(procs[n].poll() not in (None, 0) for n in procs):
                break  # one failed: the other would wait for it until the deadline
            time.sleep(1)
        return {name: proc.poll() for name, proc in procs.items() if name != "env"}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


@pytest.mark.parametrize("transport, sampler", [("zmq", "vllm"), ("filesystem", "transformers")])
def test_prime_rls_orchestrator_trains_through_arctic_rl(transport, sampler, tiny_model, tmp_path):
    """Ten steps: every batch reaches the trainer on the transport, every step's weights land through STABLE and
    the orchestrator's `/update_weights`, the orchestrator's reward rises, and ZoRRo computes each shared prompt
    once (the trainer's log). With vLLM sampling, the orchestrator sizes its concurrency from the server's
    /metrics (KV cache capacity and load, under vLLM's names)."""
    engine = {"learning_rate": LEARNING_RATE, "weight_decay": 0.01, "betas": [0.9, 0.999], "grad_clip": 1.0}
    (tmp_path / "server").mkdir()
    job = {"model_path": tiny_model, "engine": engine, "sampler": {"name": sampler, "kv_cache_mb": 64}}
    with serving(job, tmp_path / "server") as url:
        codes = _run(tmp_path, tiny_model, url, transport, LEARNING_STEPS)
    logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in ("orchestrator", "trainer")}
    # The logs' tails as text (a tuple's repr would cut them short): a failed run shows its traceback whole.
    assert codes == {"orchestrator": 0, "trainer": 0}, \
        f"{codes}\n--- orchestrator\n{logs['orchestrator'][-8000:]}\n--- trainer\n{logs['trainer'][-3000:]}"

    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/agg/all/agent/reward/mean" in m]
    assert [m["step"] for m in steps] == list(range(1, LEARNING_STEPS + 1))
    # prime-rl counts each error's type (`.../error/<type>`) and logs each failed trace's error.
    errors = [{k: v for k, v in m.items() if k.startswith("train/agg/all/error/")} for m in steps]
    failed = [line for line in logs["orchestrator"].splitlines() if "Trace failed" in line or "Empty trajectory" in line]
    assert all(m["train/agg/all/has_error/mean"] == 0 for m in steps), (errors, failed[:10])
    rewards = [m["train/agg/all/agent/reward/mean"] for m in steps]
    # Measured over ten steps: the first three's mean 0.43-0.47, the last three's 0.76-0.91 (docs/benchmarks.md). On
    # a failure, how far off-policy each step trained and which versions the orchestrator loaded say why.
    staleness = [m.get("off_policy/mean") for m in steps]
    loads = re.findall(r"Updating policy in-flight to v\d+", logs["orchestrator"])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, (rewards, staleness, loads)

    records = [json.loads(line) for line in (run / "arctic_rl_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, LEARNING_STEPS + 1))
    assert [r["weight_version"] for r in records] == list(range(1, LEARNING_STEPS + 1))
    assert all(r["samples"] == 32 and r["computed_tokens"] < r["unshared_tokens"] for r in records), records
    assert all((run / "broadcasts" / f"step_{n}" / "STABLE").exists() for n in range(LEARNING_STEPS + 1))
    # The orchestrator's weight watcher saw each version and asked the server to load it (prime-rl logs it).
    assert "Updating policy in-flight to v" in logs["orchestrator"]
    if sampler == "vllm":
        # prime-rl's concurrency controller read the engine's KV capacity off /metrics and sized its in-flight cap
        # by it (without those metrics the cap stays at min_inflight, one episode at a time).
        derived = re.search(r"Derived initial max inflight (\d+)", logs["orchestrator"])
        assert derived and int(derived.group(1)) > 1, logs["orchestrator"][-3000:]
    sent = sorted(p.name for p in (run / "rollouts").glob("step_*/rank_0.bin")) if (run / "rollouts").exists() else []
    assert (len(sent) == LEARNING_STEPS) if transport == "filesystem" else sent == []


def test_prime_rls_orchestrator_and_trainer_with_router_replay_on_a_tiny_moe(tmp_path):
    """prime-rl's own configs with `enable_router_replay` on a tiny Qwen3-MoE, the job replaying (R3): the
    orchestrator reads each turn's routing off the server's token route, its packer carries it to the trainer, and
    every trained sample replays it (the trainer refuses a batch without routes); six steps publish."""
    from compat_tests.main_server import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-qwen3-moe"), "--family", "qwen3_moe", "--max-positions", "1024")
    engine = {"learning_rate": LEARNING_RATE, "weight_decay": 0.01, "betas": [0.9, 0.999], "grad_clip": 1.0}
    (tmp_path / "server").mkdir()
    job = {"model_path": model, "engine": engine, "router_replay": "R3"}  # the vLLM sampler records the routes
    with serving(job, tmp_path / "server") as url:
        codes = _run(tmp_path, model, url, "filesystem", STEPS, replay=True)
    logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in ("orchestrator", "trainer")}
    # The logs' tails as text (a tuple's repr would cut them short): a failed run shows its traceback whole.
    assert codes == {"orchestrator": 0, "trainer": 0}, \
        f"{codes}\n--- orchestrator\n{logs['orchestrator'][-8000:]}\n--- trainer\n{logs['trainer'][-3000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "arctic_rl_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["replayed_samples"] == r["samples"] == 32 for r in records), records
