"""tinker-cookbook's own training loops (`tinker_cookbook.rl.train.main`, `tinker_cookbook.supervised.train.main`),
unmodified, against `arctic-rl serve`'s Tinker routes: the cookbook sees a Tinker service at `base_url`. Only the
tasks are ours (the cookbook's own need a hub tokenizer or data set): an RL task whose reward is the share of
sampled tokens in the lower half of the vocabulary, and supervised rows of a fixed completion."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import chz
import pytest
import tinker
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder

from compat_tests.main_server import serving, serving_light, tiny_qwen3
from compat_tests.tinker.low_tokens import VOCAB_HALF, learned, metrics, rl_config, rl_rewards

# As a user of the SDK sets it; a loopback server without a token takes any (the SDK insists on the prefix).
os.environ.setdefault("TINKER_API_KEY", "tml-loopback")
# The job's optimizer is the one the cookbook's AdamParams ask for (its defaults: betas 0.9/0.95, eps 1e-8, no
# gradient clipping); the server refuses any other.
ENGINE = {"learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": None}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One server for the module's loops on the job's key: each loop's model is a model of its own, from the base
    model, and trains as it would alone (docs/tinker.md). The cookbook's loops leave without finishing their
    sessions, which hold their models until their heartbeats stop for a minute: the 4 models the loops make fit in
    its tenants (8)."""
    work = tmp_path_factory.mktemp("server")
    with serving_light(tiny_model, work, ENGINE, "--tinker-full-parameter") as url:
        yield url


def test_cookbook_rl_loop_raises_the_reward(server, tiny_model, tmp_path):
    asyncio.run(rl_train.main(rl_config(server, tiny_model, tmp_path / "rl", learning_rate=2e-2, batches=12)))
    rewards = rl_rewards(tmp_path / "rl")
    assert len(rewards) == 12, rewards
    # From about 0.5 (a random model's share): the first steps sample the same tokens in every run, then the samples
    # depend on which requests vLLM batched together, which depends on the machine's load. At step 10 three runs read
    # 0.68 (under CI's load), 0.91 and 0.95. A run that learns nothing stays within about 0.05 of 0.5 (steps 0-3 of
    # every run), so the last three steps' mean must rise by 0.1 over the first three's.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


TENANTS = 3
BATCHES = 14
"""Each tenant's steps. A tenant's reward leaves 0.5 at step 3 to 8 and reaches 1.0 two to four steps later (18
loops on a 2-core Zen 3, 2026-12-03: the median of the last three read 1.00 in each); at 10 steps one CI run's
tenant had only begun to rise (0.42, 0.73, 0.70 at steps 8-10)."""


def test_three_tenants_run_the_cookbook_rl_loop_at_once_on_one_base_model(tiny_model, tmp_path):
    """Three users, each with their own API key, run the cookbook's RL loop at the same time against one server:
    LoRA adapters of one base model time-sharing the trainer, each sampled through vLLM's multi-LoRA."""
    keys = {f"tenant{k}": f"tml-tenant{k}-0123456789" for k in range(TENANTS)}
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    (tmp_path / "server").mkdir()
    # The output head is adapted too: the tiny model's random head keeps its logits near zero, and adapters of the
    # layers below alone barely move its distribution (the reward stays near 0.5).
    lora = {"r": 32, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "lm_head"]}
    job = {"model_path": tiny_model, "engine": {**ENGINE, "lora": lora},
           "sampler": {"name": "vllm", "adapters": TENANTS, "kv_cache_mb": 256}}
    with serving(job, tmp_path / "server", "--checkpoint-dir", str(tmp_path / "server" / "checkpoints"),
                 "--tinker-tenants", str(TENANTS), "--tinker-keys", str(tmp_path / "keys.json")) as url:
        loops = [subprocess.Popen([sys.executable, "-m", "compat_tests.tinker.low_tokens", url, tiny_model,
                                   str(tmp_path / name), "4e-2", str(BATCHES)],
                                  env={**os.environ, "TINKER_API_KEY": key},
                                  stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.log", "w"))
                 for name, key in keys.items()]
        for loop, name in zip(loops, keys):
            assert loop.wait(timeout=900) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    for name in keys:
        rewards = rl_rewards(tmp_path / name)
        assert len(rewards) == BATCHES, (name, rewards)
        # Each tenant sampled its own adapter: the sampler's log-probs are its trainer's (the cookbook's own check).
        kl = [row["optim/kl_sample_train_v1"] for row in metrics(tmp_path / name) if "optim/kl_sample_train_v1" in row]
        assert len(kl) == BATCHES and max(map(abs, kl)) < 1e-4, (name, kl)
        assert learned(rewards, rise=0.3), (name, rewards)


class FixedRows(SupervisedDataset):
    """Prompt tokens (weight 0) then a completion (weight 1) from `first` on, the same every batch."""

    def __init__(self, first: int):
        self.first = first

    def get_batch(self, index: int) -> list[tinker.Datum]:
        f = self.first
        rows = [[11, 12, 13, f - 1 + k, f, f + 1, f + 2, f + 3] for k in range(4)]
        return [tinker.Datum(model_input=tinker.ModelInput.from_ints(r[:-1]),
                             loss_fn_inputs={"target_tokens": r[1:], "weights": [0.0] * 3 + [1.0] * (len(r) - 4)})
                for r in rows]

    def __len__(self) -> int:
        return 8

    def set_epoch(self, seed: int = 0) -> None:
        pass


@chz.chz
class FixedRowsBuilder(SupervisedDatasetBuilder):
    first: int = 41

    def __call__(self):
        return FixedRows(self.first), None


def test_cookbook_supervised_loop_lowers_the_loss(server, tiny_model, tmp_path):
    config = sl_train.Config(log_path=str(tmp_path / "sl"), model_name=tiny_model, recipe_name="arctic_rl_compat",
                             dataset_builder=FixedRowsBuilder(), learning_rate=5e-3, lr_schedule="constant",
                             base_url=server, eval_every=0, save_every=0, lora_rank=32)
    asyncio.run(sl_train.main(config))
    nll = [row["train_mean_nll"] for row in metrics(tmp_path / "sl") if "train_mean_nll" in row]
    assert len(nll) == 8 and nll[-1] < 0.5 * nll[0], nll


def test_cookbook_rl_loop_starts_from_its_supervised_loops_checkpoint(server, tiny_model, tmp_path):
    """The cookbook's SFT then RL: the supervised loop saves its final state; the RL loop starts from it through
    `load_checkpoint_path` (the SDK's `create_training_client_from_state`: the weights, a fresh optimizer), both
    unmodified, on a server that holds the models of the loops before them too. The supervised rows teach tokens the
    RL reward does not pay for (the vocabulary's upper half), so the RL loop starts below a random model's reward,
    which shows it started from those weights, and raises it."""
    sl_config = sl_train.Config(log_path=str(tmp_path / "sl"), model_name=tiny_model, recipe_name="arctic_rl_sft",
                                dataset_builder=FixedRowsBuilder(first=VOCAB_HALF + 100), learning_rate=1e-2,
                                lr_schedule="constant", base_url=server, eval_every=0, save_every=0, lora_rank=32)
    asyncio.run(sl_train.main(sl_config))
    [final] = [row for row in map(json.loads, (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines())
               if row.get("name") == "final"]
    config = rl_config(server, tiny_model, tmp_path / "rl", learning_rate=2e-2)
    config = chz.replace(config, load_checkpoint_path=final["state_path"])
    asyncio.run(rl_train.main(config))
    rewards = rl_rewards(tmp_path / "rl")
    assert len(rewards) == 10, rewards
    assert rewards[0] < 0.3, rewards  # the supervised model's: well below a random one's (about 0.5)
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards
