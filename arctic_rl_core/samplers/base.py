"""The contract of a sampler: generate from its own copy of the weights, and take new weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch

from arctic_rl_core.types import Completion, SamplingParams


class Sampler(ABC):
    max_context: int

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, weight_version: int) -> list[Completion]: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the sampler's weights; return the number of tensors loaded."""
