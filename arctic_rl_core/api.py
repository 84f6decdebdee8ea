"""The training API: the one interface a framework programs against.

`InProcessBackend` implements it in this process; the HTTP client implements
the same interface against a server. Calls take and return the plain types
of `arctic_rl_core.types`; a call that raises `InvalidRequest` changed nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property

from arctic_rl_core.types import (
    AdamSettings,
    CheckpointInfo,
    Completion,
    Episode,
    FwdBwdResult,
    LogProbsResult,
    LossSpec,
    SamplingParams,
    Sequence,
    StepResult,
    ValuesResult,
)


class TrainingAPI(ABC):
    @cached_property
    def futures(self):
        """The same calls returning futures: `api.futures.fwd_bwd(...)` (see `arctic_rl_core.futures`)."""
        from arctic_rl_core.futures import ApiFutures

        return ApiFutures(self)

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 session: str | None = None) -> list[Completion]:
        """Sample `sampling.n` completions per prompt from the last synced weights; with `session`, record
        them as turns of that episode."""

    @abstractmethod
    def episode(self, session: str, release: bool = False) -> Episode:
        """The turns recorded for `session`, exactly as sampled (`Episode.sequences()` makes them training
        sequences); with `release`, forget them."""

    @abstractmethod
    def log_probs(self, sequences: list[Sequence], *, with_entropy: bool = False, temperature: float = 1.0,
                  source: str = "trainer") -> LogProbsResult:
        """Per-token log-probs (and entropy) of each response: under the trainer's current weights
        (`source="trainer"`, ZoRRo-packed), under the job's frozen reference model (`source="reference"`,
        for KL terms; `reference.enable`), or under the sampler's last synced ones (`source="sampler"`)."""

    @abstractmethod
    def values(self, sequences: list[Sequence]) -> ValuesResult:
        """The critic's value of each response token's state (`critic.enable`), under its current weights."""

    @abstractmethod
    def fwd_bwd(self, sequences: list[Sequence], loss: LossSpec, *, return_logprobs: bool = False,
                with_entropy: bool = False, model: str = "policy") -> FwdBwdResult:
        """Forward and backward of `model` ("policy", or "critic" with a critic's loss such as "value");
        gradients add up over calls until that model's `step`. With `return_logprobs` (policy), the response
        tokens' log-probs (and entropy) of the same forward come back too."""

    @abstractmethod
    def discard_gradients(self, *, model: str = "policy") -> None:
        """Drop `model`'s gradients accumulated since its last step (a failed `fwd_bwd` already leaves none of its own)."""

    @abstractmethod
    def step(self, learning_rate: float | None = None, *, adam: AdamSettings | None = None,
             model: str = "policy") -> StepResult:
        """Apply `model`'s accumulated gradients with its optimizer, with this step's AdamW settings `adam` where
        given (the job's otherwise)."""

    @abstractmethod
    def sync_weights(self) -> int:
        """Push the trainer's weights to the sampler; return the new weight version."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> CheckpointInfo:
        """Save model, optimizer and counters to directory `path`."""

    @abstractmethod
    def load_checkpoint(self, path: str, optimizer: bool = True) -> CheckpointInfo:
        """Restore what `save_checkpoint` saved; the sampler is synced to the restored weights. `optimizer=False`:
        the weights only, with a fresh optimizer (a new run from a trained model: RL from an SFT checkpoint)."""

    @abstractmethod
    def state_digest(self) -> str:
        """A hash of all weights and optimizer state: equal digests, equal training state."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """The version of the weights the sampler holds; `sync_weights` increments it."""
