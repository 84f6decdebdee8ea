"""The critic: a value model trained beside the policy, for value-based advantages (PPO with GAE).

The policy's engine with another module: the causal LM's decoder (its weights from `critic.model_path`,
default the policy's) and a linear value head, under its own DeepSpeed engine and optimizer
(`critic.engine` over the job's `engine` settings). The backend's micro-batches run through it
unchanged, ZoRRo's packed forests included, so a group's shared prompt is computed once here too.
It is never synced to a sampler.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.deepspeed_engine import DeepSpeedEngine
from arctic_rl_core.engines.response_logits import ResponseValues, model_inputs
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.losses.registry import Registered
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint


class CriticEngine(DeepSpeedEngine):
    output_keys = ("values",)
    reports_routes = False  # it replays the routes a batch carries, as the policy does; it has none of its own to report

    def __init__(self, config: BackendConfig):
        path = config.critic.model_path or config.model_path
        if not os.path.isdir(path):
            raise InvalidRequest("critic.model_path", f"{path!r} is not a directory")
        super().__init__(config.model_copy(update={"model_path": path,
                                                   "engine": config.critic.engine_config(config.engine)}))
        self.model_path = path
        self.weights_fingerprint = checkpoint_fingerprint(path)

    def _wrap(self, model: torch.nn.Module, hf_config, config: BackendConfig) -> torch.nn.Module:
        return ResponseValues(self._causal_lm, config.zorro.attention_backend)

    def _check_exactness(self, wrapper: torch.nn.Module, want_zorro: bool) -> None:
        """Nothing to check against: values are the critic's own (packed and padded forwards agree, tested)."""

    def _outputs(self, mb: MicroBatch, post: list[tuple[Registered, Any]], with_entropy: bool,
                 record_routes: bool = False) -> dict[str, torch.Tensor]:
        return {"values": self.engine(**model_inputs(mb, self.device))}

    def describe(self) -> dict:
        return {"model_path": self.model_path, "weights_fingerprint": self.weights_fingerprint, "optimizer_steps": self.steps, "zorro": self.zorro_loaded,
                "learning_rate": float(self.engine.optimizer.param_groups[0]["lr"]), "zero_stage": self.stage, "device": str(self.device)}
