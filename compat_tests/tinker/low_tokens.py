"""The compat tests' RL task for tinker-cookbook's loop: the reward is the share of sampled tokens in the lower half of
the vocabulary. `python -m compat_tests.tinker.low_tokens URL MODEL LOG_PATH LEARNING_RATE BATCHES` runs the cookbook's
`rl.train.main` on it as a user would, with the API key in $TINKER_API_KEY."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import chz
import tinker
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult

VOCAB_HALF = 256
"""Tokens below this id earn the reward."""


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


def rl_config(url: str, model: str, log_path: Path, learning_rate: float, batches: int = 10) -> rl_train.Config:
    return rl_train.Config(learning_rate=learning_rate, dataset_builder=LowTokensBuilder(batches=batches),
                           model_name=model, recipe_name="arctic_rl_compat", max_tokens=12, log_path=str(log_path),
                           base_url=url, eval_every=0, save_every=0, lora_rank=32)


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def rl_rewards(log_path: Path) -> list[float]:
    return [row["env/all/reward/total"] for row in metrics(log_path) if "env/all/reward/total" in row]


def learned(rewards: list[float], rise: float) -> bool:
    """Whether a loop learned the task: the median of its last three steps' rewards is `rise` above the mean of its
    first three. A loop that learns rises to about 1.0; on the way, one step can drop by up to 0.5 and recover at the
    next (Adam's steps at these learning rates overshoot: the trainer's own entropy rises with it, and the sampler's
    log-probs stay its trainer's), so one such step among the last three does not decide."""
    return sorted(rewards[-3:])[1] > sum(rewards[:3]) / 3 + rise


if __name__ == "__main__":
    url, model, log_path, learning_rate, batches = sys.argv[1:]
    asyncio.run(rl_train.main(rl_config(url, model, Path(log_path), float(learning_rate), int(batches))))
