"""The contract of a sampler: generate from its own copy of the weights, and take new weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import torch

from arctic_rl_core.types import Completion, SamplingParams


def process_random_state() -> dict[str, torch.Tensor]:
    """This process's torch generators: the CPU's, and each GPU's where CUDA is up."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_process_random_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all([state[f"cuda.{i}"] for i in range(torch.cuda.device_count())])


def random_state_bytes(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Generator states as bytes, to cross vLLM's RPC (whose encoding does not return tensors as tensors)."""
    return {name: tensor.numpy().tobytes() for name, tensor in state.items()}


def random_state_tensors(state: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray(data), dtype=torch.uint8) for name, data in state.items()}


class Sampler(ABC):
    max_context: int
    sync_route: str
    """How `load_weights` moves weights (reported by `status`)."""
    exact_reshaped_logprobs: bool = True
    """Whether its `logprobs_of: model` log-probs are the model's own (temperature-scaled) at every temperature when
    sampling is reshaped (`SamplingParams.reshaped_by`: truncation, min_p, min_tokens, penalties); where not, the
    backend refuses such a request by name rather than report other numbers."""
    unsupported_sampling: frozenset[str] = frozenset({"structured_outputs", "logit_bias", "allowed_token_ids",
                                                      "bad_words", "repetition_detection"})
    """Sampling parameters it cannot apply: refused by name unless at their default. A sampler applies these
    (vLLM's logits processors and grammar engines) only where it says so."""
    concurrent_generate: bool = False
    """Whether `generate` and `score` may run from several threads at once (a pool of replicas may)."""
    continuous_batching: bool = False
    """Whether concurrent calls join one running batch (vLLM's engine): callers need not gather requests into
    calls themselves."""
    streams_tokens: bool = False
    """Whether `generate` takes `on_tokens(prompt index, sample index, token ids, their log-probs, their top
    log-probs or None, their ranks)` and calls it with each engine step's new tokens."""
    cancels_calls: bool = False
    """Whether `generate` takes `cancel` (a `Cancellation`) and, once it is cancelled, ends that call's requests at
    the next engine step: the call returns what it sampled so far, finish reason `abort`."""

    adapters: int = 0
    """LoRA adapters it serves at once on its base weights (`add_adapter`, `SamplingParams.adapter`); 0: none."""
    scores_under_adapters: bool = True
    """Whether it scores prompts under an adapter (prompt log-probs, and the model's own log-probs of reshaped
    sampling, which it gets by scoring the sample again); where not, such requests are refused by name."""

    crosses_syncs: bool = False
    """Whether `load_weights` may run while `generate` calls are in flight: they go on under the new weights, each
    completion's `token_versions` saying which version sampled which token. Otherwise a sync waits for them."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, weight_version: int) -> list[Completion]: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Replace the sampler's weights with weight version `version`; return the number of tensors loaded.

        Each tensor is valid only until the next one is drawn from `weights`: copy it, don't keep it.
        """

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter saved in `path` as `name`, on the weights of version 0 (the base model)."""
        raise NotImplementedError(f"{type(self).__name__} serves no adapters")

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name`."""

    def held_weights(self) -> Iterable[tuple[str, torch.Tensor]] | None:
        """The weights it holds, named as the trainer names them (a replaced replica of a pool loads a peer's);
        None where it cannot give them."""
        return None

    @abstractmethod
    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Log-prob of each response token given its prompt and the tokens before it (temperature 1)."""

    def abort_generation(self) -> bool:
        """End the `generate` call in flight (called from another thread): it returns soon, each unfinished
        completion with what it sampled so far and finish reason `abort`. False where the sampler cannot."""
        return False

    def pause_generation(self) -> bool:
        """Freeze requests in flight (and queue new ones) until `resume_generation`; a weight update in between
        takes effect for the rest of each. False where the sampler cannot (its calls run to their end)."""
        return False

    def resume_generation(self) -> None:
        """End what `pause_generation` began."""

    def engine_metrics(self) -> str:
        """Its engine's Prometheus metrics in the text format, named as vLLM names them
        (`arctic_rl_core.samplers.engine_metrics`); empty where it has none."""
        return ""

    def random_state(self) -> dict[str, torch.Tensor]:
        """The state of the generators its unseeded sampling draws from, which a checkpoint keeps so that a resumed
        job samples what the job would have sampled next. Here: this process's (`process_random_state`), where a
        sampler that samples in this process draws."""
        return process_random_state()

    def set_random_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what `random_state` returned."""
        set_process_random_state(state)

    def sleep(self) -> None:
        """Release what generation holds (KV cache) while training runs; a sampler may have nothing to release."""

    def wake_up(self) -> None:
        """Take back what `sleep` released."""
