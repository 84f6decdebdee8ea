"""A full `python -m verl.trainer.main_ppo` GRPO run on Arctic RL: the exact command of docs/verl.md.

verl's real trainer (Ray, agent loop, reward workers, GRPO advantages, TrainingWorker) runs two
steps; generation comes from the Arctic RL server's sampler, training from its engine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import run_python

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "verl.md")
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 for a response that contains the answer's first digit: mixed rewards from a random model."""
    return float(str(ground_truth)[0] in solution_str)
'''
STEPS = 2


def documented_command(marker: str) -> str:
    text = open(DOC).read()
    block = text.split(f"<!-- compat-test: {marker} -->", 1)[1]
    return re.search(r"```bash\n(.*?)```", block, re.DOTALL).group(1)


def write_data(folder) -> None:
    code = f"""
import pandas as pd
rows = lambda n, split: pd.DataFrame([dict(
    data_source="arctic_toy", prompt=[{{"role": "user", "content": f"what is {{i}} plus {{i + 3}}?"}}], ability="math",
    reward_model={{"style": "rule", "ground_truth": str(2 * i + 3)}}, extra_info={{"index": i, "split": split}})
    for i in range(n)])
rows(16, "train").to_parquet("{folder}/train.parquet")
rows(4, "test").to_parquet("{folder}/val.parquet")
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def metric(log: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"{re.escape(name)}:(-?[0-9.eE+-]+)", log)]


GRPO = "algorithm.adv_estimator=grpo"
GAE = "algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95"


def under_gae(command: str) -> str:
    """A documented GRPO command with the estimator settings of the documented `main_ppo_gae` command, which is the
    `main_ppo` command with those in place of GRPO's."""
    assert documented_command("main_ppo_gae") == documented_command("main_ppo").replace(GRPO, GAE)
    assert command.count(GRPO) == 1, command
    return command.replace(GRPO, GAE)


UNWATCHED = "+ray_kwargs.ray_init.include_dashboard=False"
"""Each run's local Ray without its dashboard, which nothing here reads: its processes took about 5 CPU s a run."""


def run_documented(command: str, tiny_model: str, server: str, folder, steps: int, *extra: str) -> str:
    """A documented `command` (plus `extra` settings) on a two-line data set, its Ray UNWATCHED; verl's log."""
    write_data(folder)
    (folder / "reward.py").write_text(REWARD)
    # `python` in the documented command is verl's environment's.
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "ARCTIC_RL_URL": server, "MODEL": tiny_model, "DATA": str(folder),
           "REWARD": str(folder / "reward.py"), "STEPS": str(steps), "OUT": str(folder / "out"),
           "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    command = " ".join([command.rstrip(), UNWATCHED, *extra])
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                          timeout=900, env=env, cwd=folder)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log


def documented_run(command: str, tiny_model, server, client, folder) -> dict:
    """A documented `command` for STEPS steps, with the backend's status around it."""
    before, digest = client.status()["backend"], client.state_digest()
    log = run_documented(command, tiny_model, server, folder, STEPS)
    return {"before": before, "after": client.status()["backend"], "digest": digest,
            "digest_after": client.state_digest(), "log": log}


def assert_trained_the_jobs_engine_from_its_sampler(run: dict, actors: int) -> None:
    """`actors`: the job's trainer ranks and sampler replicas (one process, or 2 and 2)."""
    before, after = run["before"], run["after"]
    assert len(after["trainer"]) == len(after["sampler"]) == actors
    assert all(row["healthy"] for row in after["trainer"] + after["sampler"])
    # Generation came from Arctic RL's sampler: 16 prompts x n=4 per step went through its generate.
    assert after["generated"]["completions"] - before["generated"]["completions"] >= STEPS * 4 * 4
    # The trainer's weights changed and were synced into the sampler at start and after each step.
    assert run["digest_after"] != run["digest"]
    assert after["optimizer_steps"] - before["optimizer_steps"] == STEPS
    assert after["weight_version"] - before["weight_version"] >= STEPS


def assert_verls_loss_is_the_backends(log: str) -> None:
    # verl's reported policy loss (its own ppo_loss on our log-probs) equals the loss our backend trained on.
    verl_loss, arctic_loss = metric(log, "actor/pg_loss"), metric(log, "actor/arctic/loss")
    assert len(verl_loss) == len(arctic_loss) == STEPS, log[-3000:]
    for ours, theirs in zip(arctic_loss, verl_loss):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)
    assert metric(log, "actor/arctic/groups") == [4.0] * STEPS  # each mini-batch's 4 groups, whole


# verl's synchronous trainer runs twice. The adapter's config runs PPO with GAE and R3 on a tiny Qwen3-MoE against
# the one-process job with a critic (`main_ppo_r3` with `main_ppo_gae`'s estimator: a run per feature cost a verl run
# each, about 80 CPU s); verl's own config with the native keys runs GRPO against the 2-rank, 2-replica job (run.sh).
# The config path and the job's shape are independent (verl sees the same API), so each pairing is run once, each
# with the whole set of checks; GRPO on the dense model also runs under the asynchronous trainer.
PROBE = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10]}]


@pytest.fixture(scope="module")
def r3_gae_run(moe_server, tmp_path_factory):
    from arctic_rl_core.client import ArcticRLClient

    model, url = moe_server
    client = ArcticRLClient(url)
    values_before = client.values(PROBE).values
    run = documented_run(under_gae(documented_command("main_ppo_r3")), model, url, client,
                         tmp_path_factory.mktemp("main_ppo_r3_gae"))
    return {**run, "values_before": values_before, "values_after": client.values(PROBE).values}


@pytest.fixture(scope="module")
def native_keys_run(tiny_model, server, client, tmp_path_factory):
    return documented_run(documented_command("main_ppo_native"), tiny_model, server, client,
                          tmp_path_factory.mktemp("main_ppo_native"))


def test_main_ppo_steps_run_on_arctic_rl(r3_gae_run):
    assert_trained_the_jobs_engine_from_its_sampler(r3_gae_run, actors=1)


def test_main_ppo_reports_the_loss_arctic_rl_trained_on(r3_gae_run):
    assert_verls_loss_is_the_backends(r3_gae_run["log"])


def test_verls_own_config_with_the_native_keys_runs_grpo_steps_on_arctic_rl(native_keys_run):
    # The job verl talked to: 2 trainer ranks and 2 sampler replicas (run.sh's ARCTIC_RL_COMPAT_JOB=distributed).
    actors = 2 if os.environ.get("ARCTIC_RL_COMPAT_JOB") == "distributed" else 1
    assert_trained_the_jobs_engine_from_its_sampler(native_keys_run, actors)


def test_verls_own_config_with_the_native_keys_reports_the_loss_arctic_rl_trained_on(native_keys_run):
    assert_verls_loss_is_the_backends(native_keys_run["log"])


def test_verls_colocated_async_trainer_trains_on_arctic_rl_off_policy(tiny_model, server, client, tmp_path):
    """`trainer.v1.trainer_mode=colocate_async`: verl's own asynchronous trainer, the next batch sampled while the
    backend trains. Its samples reach the update a step stale (verl's staleness, from the step of each sample's
    oldest weights), and the loss trained is still verl's."""
    steps = 3
    before = client.status()["backend"]
    log = run_documented(documented_command("main_ppo"), tiny_model, server, tmp_path, steps,
                         "trainer.v1.trainer_mode=colocate_async")
    after = client.status()["backend"]
    assert after["optimizer_steps"] - before["optimizer_steps"] == steps
    stale = [int(v) for v in re.findall(r"training/off_policy/trajectory_staleness/max:(?:np\.\w+\()?(\d+)", log)]
    assert len(stale) == steps and 1 <= max(stale) <= 8, log[-3000:]  # verl's bound: 8 versions (its default)
    verl_loss, arctic_loss = metric(log, "actor/pg_loss"), metric(log, "actor/arctic/loss")
    assert len(arctic_loss) == steps and all(ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)
                                             for ours, theirs in zip(arctic_loss, verl_loss))


def test_main_ppo_with_router_replay_r3_replays_every_sampled_sequence(r3_gae_run):
    """verl's R3 (`router_replay.mode=R3`, `rollout.enable_rollout_routing_replay`): every sequence of every update
    carries the routing the job's sampler recorded, through verl's agent loop and batches."""
    log = r3_gae_run["log"]
    assert metric(log, "actor/arctic/replayed_sequences") == [16.0] * STEPS, log[-3000:]


def run_python_module(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_unknown_settings_fail_at_start_up(tiny_model, tmp_path):
    base = ["-m", "verl.trainer.main_ppo", "--config-name", "arctic_ppo_trainer", "--cfg", "job"]
    wrong_key = run_python_module(base + ["trainer.backend=arctic-rl", "actor_rollout_ref.actor.arctic.urll=http://x"])
    assert wrong_key.returncode != 0 and "Key 'urll' is not in struct" in wrong_key.stderr
    wrong_backend = run_python_module(base + ["trainer.backend=fsdp", "--resolve"])
    assert wrong_backend.returncode != 0
    assert "trainer.backend='fsdp': the arctic_ppo_trainer config serves arctic-rl" in wrong_backend.stderr


def test_the_job_block_is_set_whole_from_the_command_line():
    composed = run_python_module(["-m", "verl.trainer.main_ppo", "--config-name", "arctic_ppo_trainer", "--cfg", "job",
                                  "trainer.backend=arctic-rl",
                                  "actor_rollout_ref.actor.arctic.job={sampler:{name:vllm},engine:{zero_stage:0}}"])
    assert composed.returncode == 0, composed.stderr[-2000:]
    job = yaml.safe_load(composed.stdout)["actor_rollout_ref"]["actor"]["arctic"]["job"]
    assert job == {"sampler": {"name": "vllm"}, "engine": {"zero_stage": 0}}


def test_main_ppo_with_gae_trains_verls_critic_on_arctic_rl(r3_gae_run):
    """PPO with GAE: verl's critic worker reads values from, and trains, the job's critic; its value loss is the
    backend's, step by step."""
    before, after, log = r3_gae_run["before"], r3_gae_run["after"], r3_gae_run["log"]
    assert after["critic"]["optimizer_steps"] - before["critic"]["optimizer_steps"] == STEPS
    verl_loss, arctic_loss = metric(log, "critic/vf_loss"), metric(log, "critic/arctic/loss")
    assert len(verl_loss) == len(arctic_loss) == STEPS, log[-3000:]
    for ours, theirs in zip(arctic_loss, verl_loss):
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6)
    assert metric(log, "critic/arctic/groups") == [4.0] * STEPS  # each mini-batch's 4 groups, whole
    assert r3_gae_run["values_after"] != r3_gae_run["values_before"]
