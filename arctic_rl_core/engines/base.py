"""The contract between the backend and a training engine.

The backend validates requests and builds micro-batches; the engine owns
the model, the optimizer and their state. Engines are discovered through
the `arctic_rl_training_engines` plugin hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.losses.registry import Registered
from arctic_rl_core.models.lora_shape import AdapterLayout, AdapterShape
from arctic_rl_core.types import AdamSettings


class TrainingEngine(ABC):
    max_context: int
    vocab_size: int
    pad_token_id: int
    concurrent_forward: bool
    """Whether a no-grad `forward` may run while `forward_backward` runs (not under ZeRO-3,
    whose parameter gathering is not thread-safe)."""

    @abstractmethod
    def forward_backward(
        self, micro_batches: list[MicroBatch], loss: Registered, loss_config, post: list[tuple[Registered, object]],
        scales: list[float] | None = None, keep_outputs: bool = False, with_entropy: bool = False,
    ) -> tuple[float, dict[str, float], list[dict[str, torch.Tensor]] | None]:
        """Accumulate gradients of the loss over all micro-batches; return the loss, additive metrics and, with
        `keep_outputs`, each micro-batch's per-token "logprobs" (and "entropy" with `with_entropy`) from the
        same forward, detached.

        `scales` (a trainer group's ranks) multiplies each micro-batch's loss before its backward; the
        returned loss and metrics are unscaled and leave out micro-batches scaled by 0."""

    @abstractmethod
    def forward(
        self, micro_batches: list[MicroBatch], post: list[tuple[Registered, object]], with_entropy: bool
    ) -> list[tuple[MicroBatch, dict[str, torch.Tensor]]]:
        """Per-token outputs ("logprobs", optionally "entropy") without gradients."""

    @abstractmethod
    def discard_gradients(self) -> None:
        """Drop all gradients accumulated since the last step."""

    @abstractmethod
    def optimizer_step(self, learning_rate: float | None, adam: AdamSettings | None = None) -> tuple[float, float]:
        """Apply accumulated gradients with this step's AdamW settings (the job's where `adam` leaves them out);
        return (grad_norm, learning_rate). Clears gradients."""

    @property
    @abstractmethod
    def has_gradients(self) -> bool: ...

    @property
    @abstractmethod
    def steps(self) -> int: ...

    @abstractmethod
    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered, LoRA-merged) weights under the base model's parameter names."""

    @abstractmethod
    def save(self, path: str, client_state: dict, trainable_only: bool = False) -> None:
        """Model and optimizer state; `trainable_only` leaves out frozen weights (a LoRA job's base model)."""

    @abstractmethod
    def load(self, path: str, trainable_only: bool = False, optimizer: bool = True) -> dict:
        """Restore model and optimizer; return the client state saved with them. `trainable_only`: the checkpoint
        holds only the trainable weights, and the frozen ones stay as they are. `optimizer=False`: the weights
        only, with a fresh optimizer (no moments, as a new engine's)."""

    def save_adapter(self, path: str) -> None:
        """A LoRA engine's adapter, as PEFT's `save_pretrained` writes it (weights, no optimizer), in the shape
        `shape_adapter` set."""
        raise NotImplementedError(f"{type(self).__name__} trains no adapter")

    def adapter_layout(self) -> AdapterLayout | None:
        """A LoRA engine's adapter: its rank and adapted modules (None: the engine trains all parameters)."""
        return None

    def shape_adapter(self, shape: AdapterShape | None) -> None:
        """From now on the adapter trains and computes as a smaller one (`models/lora_shape.py`); None: all of it."""
        if shape is not None:
            raise NotImplementedError(f"{type(self).__name__} cannot shape its adapter")

    @abstractmethod
    def state_digest(self) -> str:
        """A hash of all weights and optimizer state: equal digests, equal training state."""
