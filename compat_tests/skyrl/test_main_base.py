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

import pandas as pd

from conftest import QUESTIONS

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "skyrl.md")
STEPS = 2
BATCH, N, MINI = 2, 4, 1  # the documented command's train_batch_size, n_samples_per_prompt, policy_mini_batch_size


def documented_command(marker: str) -> str:
    block = open(DOC).read().split(f"<!-- compat-test: {marker} -->", 1)[1]
    return re.search(r"```bash\n(.*?)```", block, re.DOTALL).group(1)


def write_data(folder) -> None:
    """GSM8K's layout, as SkyRL's gsm8k example writes it: chat messages, env class, the answer to check."""
    pd.DataFrame([{"data_source": "arctic_toy", "prompt": [{"role": "user", "content": question}], "env_class": "gsm8k",
                   "reward_spec": {"method": "rule", "ground_truth": right}, "extra_info": {"split": "train"}}
                  for question, (right, _) in QUESTIONS.items()]).to_parquet(folder / "train.parquet")


def scalars(folder) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_main_base_grpo_steps_run_on_arctic_rl(tiny_model, server, client, gsm8k_model, tmp_path):
    write_data(tmp_path)
    before = client.status()
    digest = client.state_digest()
    # `python` in the documented command is SkyRL's environment's; SkyRL's tensorboard logger records the
    # metrics at full precision (the documented console logger prints four decimals).
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "ARCTIC_RL_URL": server,
           "MODEL": tiny_model, "DATA": str(tmp_path), "STEPS": str(STEPS), "OUT": str(tmp_path / "out"),
           "TENSORBOARD_DIR": str(tmp_path / "tb"), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = documented_command("main_base").rstrip() + " trainer.logger=tensorboard"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    after = client.status()
    metrics = scalars(tmp_path / "tb")
    assert len(metrics["policy/final_loss"]) == STEPS, sorted(metrics)

    # Every completion SkyRL trained on came from the server's sampler, through SkyRL's own client.
    generated = after["serving"]["requests"]["generate"] - before["serving"]["requests"]["generate"]
    assert generated == STEPS * BATCH * N
    assert after["backend"]["generated"]["completions"] - before["backend"]["generated"]["completions"] == generated
    # The rewards were mixed (the warm-up answers half rightly), so the loss had something to train on ...
    rewards = metrics["reward/avg_raw_reward"]
    assert any(0 < r < 1 for r in rewards), rewards
    assert any(abs(v) > 1e-4 for v in metrics["policy/final_loss"]), metrics["policy/final_loss"]
    # ... and the loss the backend took gradients of is SkyRL's, on the same log-probs: SkyRL's own loss code
    # (its PolicyLossRegistry, on the log-probs of the backend's forward) gives the same value at every step.
    for ours, skyrl in zip(metrics["policy/arctic_loss"], metrics["policy/final_loss"]):
        assert math.isclose(ours, skyrl, rel_tol=1e-5, abs_tol=1e-7), (ours, skyrl)
    # The weights changed on the server, by one optimizer step per mini-batch, and were synced to the sampler.
    assert client.state_digest() != digest
    assert after["backend"]["optimizer_steps"] - before["backend"]["optimizer_steps"] == STEPS * BATCH // MINI
    assert after["backend"]["weight_version"] - before["backend"]["weight_version"] == STEPS + 1  # + the sync at start
    # Groups arrived whole: each mini-batch was one group of N rows, its prompt computed once.
    assert metrics["policy/arctic_groups"] == [MINI] * STEPS
    for computed, rows in zip(metrics["policy/arctic_computed_tokens"], metrics["policy/arctic_row_tokens"]):
        assert computed < rows
