"""A full `python -m skyrl.train.entrypoints.main_base` GRPO run on Arctic RL: the exact command of docs/skyrl.md.

SkyRL's real trainer (its generator, SkyRL-Gym's gsm8k environment, GRPO advantages, mini-batch loop,
metrics) runs two steps; generation comes from the Arctic RL server's sampler through SkyRL's own
inference client, training from the server's engine.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import httpx
import pandas as pd
import pytest

from conftest import QUESTIONS

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "skyrl.md")
STEPS = 2
BATCH, N, MINI = 2, 4, 1  # the documented command's train_batch_size, n_samples_per_prompt, policy_mini_batch_size


def documented_command(marker: str) -> str:
    block = open(DOC).read().split(f"<!-- compat-test: {marker} -->", 1)[1]
    return re.search(r"```bash\n(.*?)```", block, re.DOTALL).group(1)


def write_data(folder, env_class: str = "gsm8k", max_turns: int = 1, ground_truth: str | None = None) -> None:
    """GSM8K's layout, as SkyRL's gsm8k example writes it: chat messages, env class, the answer to check (each
    question's right one, or `ground_truth` for all)."""
    pd.DataFrame([{"data_source": "arctic_toy", "prompt": [{"role": "user", "content": question}], "env_class": env_class,
                   "reward_spec": {"method": "rule", "ground_truth": ground_truth or right},
                   "extra_info": {"split": "train", "max_turns": max_turns}}
                  for question, (right, _) in QUESTIONS.items()]).to_parquet(folder / "train.parquet")


def scalars(folder) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_documented(server: str, model: str, folder, steps: int, *extra: str) -> dict[str, list[float]]:
    """The documented command (plus `extra` overrides); the metrics SkyRL logged, per step."""
    # `python` in the documented command is SkyRL's environment's; SkyRL's tensorboard logger records the
    # metrics at full precision (the documented console logger prints four decimals).
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "ARCTIC_RL_URL": server,
           "MODEL": model, "DATA": str(folder), "STEPS": str(steps), "OUT": str(folder / "out"),
           "TENSORBOARD_DIR": str(folder / "tb"), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = " ".join([documented_command("main_base").rstrip(), "trainer.logger=tensorboard", *extra])
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=folder)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    metrics = scalars(folder / "tb")
    assert len(metrics["policy/final_loss"]) == steps, sorted(metrics)
    return metrics


def assert_the_backend_trained_skyrls_loss(metrics: dict[str, list[float]]) -> None:
    """The loss the backend took gradients of is SkyRL's, on the same log-probs: SkyRL's own loss code (its
    PolicyLossRegistry, on the log-probs of the backend's forward) gives the same value at every step; and each
    mini-batch arrived as one whole group of N rows, its prompt computed once."""
    # fp32: a step's loss is a sum of per-token terms of both signs that nearly cancel (GRPO's advantages sum to 0
    # over a group), so beside 1e-5 relative, 1e-7 absolute: the rounding of terms of about 0.1.
    for ours, skyrl in zip(metrics["policy/arctic_loss"], metrics["policy/final_loss"]):
        assert math.isclose(ours, skyrl, rel_tol=1e-5, abs_tol=1e-7), (ours, skyrl)
    assert metrics["policy/arctic_groups"] == [MINI] * len(metrics["policy/arctic_groups"])
    for computed, rows in zip(metrics["policy/arctic_computed_tokens"], metrics["policy/arctic_row_tokens"]):
        assert computed < rows


PROBE = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10]}]
"""A critic's input whose value GAE's run must change."""


@pytest.fixture(scope="module")
def gae_run(tiny_model, server, client, gsm8k_model, tmp_path_factory) -> dict:
    """SkyRL's GAE through the documented command, STEPS steps: its critic is the job's. The one run of SkyRL's
    synchronous trainer on the dense model with its default PPO policy loss (GRPO's advantages run in the
    multi-turn, asynchronous and R3 runs): the backend's status, state digest and the probe's value around it."""
    folder = tmp_path_factory.mktemp("gae")
    write_data(folder)
    before, digest, values = client.status(), client.state_digest(), client.values(PROBE).values
    metrics = run_documented(server, tiny_model, folder, STEPS, "trainer.algorithm.advantage_estimator=gae",
                             f"trainer.critic.model.path={tiny_model}", "trainer.critic_mini_batch_size=1",
                             "trainer.critic.optimizer_config.lr=1e-3")
    return {"before": before, "after": client.status(), "digest": digest, "digest_after": client.state_digest(),
            "values": values, "values_after": client.values(PROBE).values, "metrics": metrics}


def test_main_base_steps_run_on_arctic_rl(gae_run):
    before, after, metrics = gae_run["before"], gae_run["after"], gae_run["metrics"]
    # Every completion SkyRL trained on came from the server's sampler, through SkyRL's own client.
    generated = after["serving"]["requests"]["generate"] - before["serving"]["requests"]["generate"]
    assert generated == STEPS * BATCH * N
    assert after["backend"]["generated"]["completions"] - before["backend"]["generated"]["completions"] == generated
    # The rewards were mixed (the warm-up answers half rightly), so the loss had gradients to train on.
    rewards = metrics["reward/avg_raw_reward"]
    assert any(0 < r < 1 for r in rewards), rewards
    assert any(v > 1e-4 for v in metrics["policy/grad_norm"]), metrics["policy/grad_norm"]
    # SkyRL's default KL loss ran against the job's reference model (the initial weights, which the warm-up left).
    assert all(v > 1e-3 for v in metrics["policy/policy_kl"]), metrics["policy/policy_kl"]
    assert_the_backend_trained_skyrls_loss(metrics)
    # The weights changed on the server, by one optimizer step per mini-batch, and were synced to the sampler.
    assert gae_run["digest_after"] != gae_run["digest"]
    assert after["backend"]["optimizer_steps"] - before["backend"]["optimizer_steps"] == STEPS * BATCH // MINI
    assert after["backend"]["weight_version"] - before["backend"]["weight_version"] == STEPS + 1  # + the sync at start


def test_multi_turn_episodes_of_skyrl_gym_train_on_arctic_rl(tiny_model, server, client, gsm8k_model, tmp_path):
    """SkyRL-Gym's gsm8k_multi_turn: a wrong answer gets a user turn asking again, up to 3 turns. Each turn is one
    request to the server; the episode trains as one row, its environment turns masked out of the loss.

    Every episode takes all 3 turns, whatever is sampled: the ground truth is no number (the environment's strict
    parser extracts digits only, so no reply can match it), and the context limit holds 3 turns of the longest
    replies (a 22-token prompt, 48-token replies, SkyRL-Gym's two follow-up messages of about 100 and 70 tokens)."""
    write_data(tmp_path, "gsm8k_multi_turn", max_turns=3, ground_truth="no number")
    before = client.status()["serving"]["requests"]["generate"]
    metrics = run_documented(server, tiny_model, tmp_path, 1, "environment.env_class=gsm8k_multi_turn",
                             "generator.max_turns=3", "generator.sampling_params.max_generate_length=48",
                             "trainer.max_prompt_length=320")
    assert metrics["environment/avg_steps"] == [3.0]
    generated = client.status()["serving"]["requests"]["generate"] - before
    assert generated == 3 * BATCH * N  # every turn sampled by the server
    assert_the_backend_trained_skyrls_loss(metrics)


def test_ppo_with_gae_trains_skyrls_critic_on_the_jobs_critic(gae_run):
    """SkyRL's GAE: its critic is the job's. The values SkyRL's advantages are computed from come from `values`, each
    critic mini-batch is one `fwd_bwd(model="critic")`, and the value loss the backend took gradients of equals SkyRL's
    own `ppo_critic_loss` on the values of that forward, at every step."""
    before, after, metrics = gae_run["before"]["backend"], gae_run["after"]["backend"], gae_run["metrics"]
    for ours, skyrl in zip(metrics["critic/arctic_loss"], metrics["critic/critic_loss"], strict=True):
        assert math.isclose(ours, skyrl, rel_tol=1e-5, abs_tol=1e-7), (ours, skyrl)
    assert len(metrics["critic/critic_loss"]) == STEPS
    assert metrics["critic/arctic_groups"] == [1.0] * STEPS  # each critic mini-batch, one whole group
    assert after["critic"]["optimizer_steps"] - before["critic"]["optimizer_steps"] == STEPS * BATCH
    assert gae_run["values_after"] != gae_run["values"]  # the critic trained


def test_skyrls_fully_async_trainer_trains_on_arctic_rl_one_step_stale(tiny_model, server, client, gsm8k_model,
                                                                       tmp_path):
    """`trainer.fully_async.enabled=true`: SkyRL's own asynchronous trainer, its generation workers sampling from the
    server while the backend trains, the weights synced after each step. Two workers and a buffer of two groups:
    the second group is scheduled before the first step's update, so it trains one step stale, as SkyRL reports."""
    write_data(tmp_path)
    steps = 3
    before = client.status()["backend"]
    metrics = run_documented(server, tiny_model, tmp_path, steps, "trainer.fully_async.enabled=true",
                             "trainer.fully_async.max_staleness_steps=1",
                             "trainer.fully_async.num_parallel_generation_workers=2", "trainer.train_batch_size=1",
                             "generator.batched=false", "trainer.algorithm.policy_loss_type=cispo",
                             "trainer.algorithm.cispo.cispo_anchor=rollout")
    after = client.status()["backend"]
    assert max(metrics["async/staleness_max"]) == 1 and metrics["async/staleness_violation_count"] == [0.0] * steps
    assert after["optimizer_steps"] - before["optimizer_steps"] == steps
    assert after["weight_version"] - before["weight_version"] == steps + 1  # + the sync at start
    assert_the_backend_trained_skyrls_loss(metrics)


def test_router_replay_r3_replays_the_samplers_routing_in_every_update(tmp_path):
    """SkyRL's R3 on a tiny Qwen3-MoE: SkyRL's own keys turn it on (its Megatron flag, with its generator asking for
    the routing), its generator's requests go to the server's /skyrl/v1/generate and get the routing the sampler
    recorded, packed as SkyRL's client decodes it, and every row of every update replays its recorded routing; the
    loss the backend took gradients of is still SkyRL's."""
    from compat_tests.main_server import make_tiny_model, serving

    from conftest import LEARNING_RATE, OPTIMIZER

    model = make_tiny_model(str(tmp_path / "tiny-qwen3-moe"), "--family", "qwen3_moe", "--max-positions", "1024")
    job = {"model_path": model, "router_replay": "R3",  # the vLLM sampler records the routes
           "engine": {"learning_rate": LEARNING_RATE, **OPTIMIZER}, "reference": {"enable": True}}
    (tmp_path / "server").mkdir()
    write_data(tmp_path)
    with serving(job, tmp_path / "server", "--checkpoint-dir", str(tmp_path / "server" / "checkpoints")) as url:
        metrics = run_documented(url, model, tmp_path, STEPS, "trainer.strategy=megatron",
                                 "trainer.policy.megatron_config.moe_enable_routing_replay=true",
                                 "generator.inference_engine.enable_return_routed_experts=true",
                                 "generator.inference_engine.distributed_executor_backend=mp")
        served = httpx.get(f"{url}/v1/status").json()["serving"]["requests"]["generate"]
    assert served == STEPS * BATCH * N  # each rollout through /skyrl/v1/generate
    assert metrics["policy/arctic_replayed_sequences"] == [float(MINI * N)] * STEPS  # every row of every update
    assert_the_backend_trained_skyrls_loss(metrics)
