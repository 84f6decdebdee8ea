"""The bench's reward as a single-turn SkyRL-Gym environment."""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class SqlEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        if "ground_truth" not in extras.get("reward_spec", {}):
            raise ValueError("reward_spec.ground_truth: required (the answer whose first digit earns the reward)")
        self.answer = str(extras["reward_spec"]["ground_truth"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=float(self.answer[:1] in action), done=True, metadata={})
