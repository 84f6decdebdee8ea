"""tinker-cookbook's own training loops (`tinker_cookbook.rl.train.main`, `tinker_cookbook.supervised.train.main`),
unmodified, against `arctic-rl serve`'s Tinker routes: the cookbook sees a Tinker service at `base_url`. Only the
tasks are ours (the cookbook's own need a hub tokenizer or data set): an RL task whose reward is the share of
sampled tokens in the lower half of the vocabulary, and supervised rows of a fixed completion."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

import chz
import pytest
import tinker
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder

from compat_tests.main_server import serving_light, tiny_qwen3

# As a user of the SDK sets it; a loopback server without a token takes any (the SDK insists on the prefix).
os.environ.setdefault("TINKER_API_KEY", "tml-loopback")
# The job's optimizer is the one the cookbook's AdamParams ask for (its defaults: betas 0.9/0.95, eps 1e-8, no
# gradient clipping); the server refuses any other.
ENGINE = {"learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": None}
VOCAB_HALF = 256
"""Tokens below this id earn the RL task's reward."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("model"))


@pytest.fixture
def server(tiny_model, tmp_path):
    """A server per loop: the cookbook's loops leave without finishing their sessions, which hold the job's model
    until their heartbeats stop for a minute."""
    (tmp_path / "server").mkdir()
    with serving_light(tiny_model, tmp_path / "server", ENGINE, "--tinker-full-parameter") as url:
        yield url


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


class LowTokensEnv(Env):
    def __init__(self, prompt: tuple[int, ...]):
        self.prompt = prompt

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(list(self.prompt)), []  # no stop: every sample is max_tokens long

    async def step(self, action, *, extra=None):
        return StepResult(reward=sum(t < VOCAB_HALF for t in action) / max(len(action), 1), episode_done=True,
                          next_observation=tinker.ModelInput.empty(), next_stop_condition=[])


@dataclass(frozen=True)
class LowTokensGroup(EnvGroupBuilder):
    prompt: tuple[int, ...]
    group_size: int

    async def make_envs(self):
        return [LowTokensEnv(self.prompt) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["low_tokens"]


class LowTokensDataset(RLDataset):
    def __init__(self, batches: int, groups: int, group_size: int):
        self.batches, self.groups, self.group_size = batches, groups, group_size

    def get_batch(self, index: int):
        return [LowTokensGroup(prompt=(11, 12, 13 + g, 14 + index), group_size=self.group_size) for g in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class LowTokensBuilder(RLDatasetBuilder):
    batches: int = 10
    groups: int = 4
    group_size: int = 8

    async def __call__(self):
        return LowTokensDataset(self.batches, self.groups, self.group_size), None


def test_cookbook_rl_loop_raises_the_reward(server, tiny_model, tmp_path):
    config = rl_train.Config(learning_rate=2e-2, dataset_builder=LowTokensBuilder(), model_name=tiny_model,
                             recipe_name="arctic_rl_compat", max_tokens=12, log_path=str(tmp_path / "rl"),
                             base_url=server, eval_every=0, save_every=0, lora_rank=32)
    asyncio.run(rl_train.main(config))
    rows = [row for row in metrics(tmp_path / "rl") if "env/all/reward/total" in row]
    rewards = [row["env/all/reward/total"] for row in rows]
    assert len(rewards) == 10, rewards
    # From about 0.5 (a random model's share) to about 0.8 in three runs; the bound leaves room for sampling's luck.
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards


class FixedRows(SupervisedDataset):
    """Prompt tokens (weight 0) then a completion (weight 1), the same every batch."""

    def get_batch(self, index: int) -> list[tinker.Datum]:
        rows = [[11, 12, 13, 40 + k, 41, 42, 43, 44] for k in range(4)]
        return [tinker.Datum(model_input=tinker.ModelInput.from_ints(r[:-1]),
                             loss_fn_inputs={"target_tokens": r[1:], "weights": [0.0] * 3 + [1.0] * (len(r) - 4)})
                for r in rows]

    def __len__(self) -> int:
        return 8

    def set_epoch(self, seed: int = 0) -> None:
        pass


@chz.chz
class FixedRowsBuilder(SupervisedDatasetBuilder):
    def __call__(self):
        return FixedRows(), None


def test_cookbook_supervised_loop_lowers_the_loss(server, tiny_model, tmp_path):
    config = sl_train.Config(log_path=str(tmp_path / "sl"), model_name=tiny_model, recipe_name="arctic_rl_compat",
                             dataset_builder=FixedRowsBuilder(), learning_rate=5e-3, lr_schedule="constant",
                             base_url=server, eval_every=0, save_every=0, lora_rank=32)
    asyncio.run(sl_train.main(config))
    nll = [row["train_mean_nll"] for row in metrics(tmp_path / "sl") if "train_mean_nll" in row]
    assert len(nll) == 8 and nll[-1] < 0.5 * nll[0], nll
