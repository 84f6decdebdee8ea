"""prime-rl's training batches, read off the wire and made Arctic RL sequences.

The orchestrator packs each step's samples into `MicroBatch`es (prime-rl 0.8.0,
`transports/rollouts/types.py`): msgpack, array-like structs, several samples per row with
position ids restarting at 0 for each. A sample is one flat token sequence with a per-token
`loss_mask` marking the tokens the model sampled; a multi-turn sample interleaves sampled
spans with context. Here a sample becomes one `Sequence`: the tokens before its first
trainable one are its prompt, the rest its response (context tokens inside it masked out),
and samples with the same prompt share a group, so ZoRRo computes that prompt once.

The structs below mirror prime-rl's wire format field for field (a reader needs msgspec
only, not prime-rl); compat_tests/primerl decodes what prime-rl's own sender encodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

import numpy as np

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import RoutedExperts as Routes
from arctic_rl_core.types import Sequence


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


DECODER = msgspec.msgpack.Decoder(type=list[MicroBatch])

PER_TOKEN = ("loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures", "env_names")
REFUSED = {
    "mm_kwargs": "multimodal inputs are not supported",
    "mm_token_type_ids": "multimodal inputs are not supported",
    "ce_weights": "the cross-entropy loss component (ce_weights) is not supported: train it with the sft loss",
    "ref_kl_weights": "the reference-KL loss component (on-policy distillation) is not supported",
}


@dataclass
class Sample:
    """One sample of a micro-batch, its per-token arrays cut to its own span."""

    token_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    temperatures: list[float]
    env_name: str
    where: str
    routes: np.ndarray | None = None
    """[tokens, layers, top_k]: the experts the sampler routed each token to (router replay)."""


_ROUTE_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64")


def _routes(batch: MicroBatch, where: str) -> np.ndarray:
    """A row's routed experts ([tokens, layers, top_k], prime-rl's raw bytes) as an array, checked."""
    routes, n = batch.routed_experts, len(batch.input_ids)
    if routes.dtype not in _ROUTE_DTYPES:
        raise InvalidRequest(f"{where}.routed_experts.dtype", f"is {routes.dtype!r}; expected one of {', '.join(_ROUTE_DTYPES)}")
    if len(routes.shape) != 3 or routes.shape[0] != n or min(routes.shape) < 1:
        raise InvalidRequest(f"{where}.routed_experts.shape", f"is {routes.shape}; expected [{n} tokens, layers, top_k]")
    dtype = np.dtype(routes.dtype)
    if len(routes.data) != int(np.prod(routes.shape)) * dtype.itemsize:
        raise InvalidRequest(f"{where}.routed_experts.data", f"holds {len(routes.data)} bytes, not shape {routes.shape} "
                             f"of {routes.dtype}")
    return np.frombuffer(routes.data, dtype=dtype).reshape(routes.shape)


@dataclass
class StepBatch:
    """A step's trainable samples as sequences, one list per sampling temperature."""

    by_temperature: dict[float, list[Sequence]] = field(default_factory=dict)
    samples: int = 0
    """Samples with at least one trainable token (padding and dummy rows are not samples)."""
    envs: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(int(sum(s.loss_mask)) for seqs in self.by_temperature.values() for s in seqs)

    @property
    def unshared_tokens(self) -> int:
        """Positions a forward of each sequence alone would compute: what ZoRRo's shared prompts save from."""
        return sum(len(s.prompt_ids) + len(s.response_ids) for seqs in self.by_temperature.values() for s in seqs)


def decode(payload: bytes | memoryview) -> list[MicroBatch]:
    """A rank's micro-batches as the orchestrator sent them (one ZMQ message or one `rank_r.bin`)."""
    try:
        return DECODER.decode(payload)
    except msgspec.DecodeError as err:
        raise InvalidRequest("micro_batches", f"is not a prime-rl list[MicroBatch] message: {err}") from None


def samples_of(batch: MicroBatch, where: str, replay: bool = False) -> list[Sample]:
    """Split a packed row on its position resets (a reset starts a sample; padding is a sample of its own). With
    `replay` (prime-rl's `enable_router_replay`) each sample keeps its span of the row's routed experts; without,
    they are dropped, as prime-rl's trainer drops them."""
    for name, reason in REFUSED.items():
        if getattr(batch, name) is not None:
            raise InvalidRequest(f"{where}.{name}", reason)
    routes = None
    if replay:
        if batch.routed_experts is None:
            raise InvalidRequest(f"{where}.routed_experts", "is missing: enable_router_replay is set, so the inference "
                                 "server must return routed experts (the Arctic RL job's router_replay: R3)")
        routes = _routes(batch, where)
    n = len(batch.input_ids)
    for name in PER_TOKEN:
        if len(getattr(batch, name)) != n:
            raise InvalidRequest(f"{where}.{name}", f"has {len(getattr(batch, name))} entries, input_ids {n}")
    mask = list(batch.loss_mask)
    if batch.rl_weights is not None:
        if len(batch.rl_weights) != n:
            raise InvalidRequest(f"{where}.rl_weights", f"has {len(batch.rl_weights)} entries, input_ids {n}")
        bad = next((i for i, w in enumerate(batch.rl_weights) if w not in (0.0, 1.0)), None)
        if bad is not None:
            raise InvalidRequest(f"{where}.rl_weights[{bad}]", f"is {batch.rl_weights[bad]}: only weights 0 and 1 "
                                 "(a token in or out of the rl loss) are supported")
        mask = [m and w != 0 for m, w in zip(mask, batch.rl_weights)]
    starts = [i for i, p in enumerate(batch.position_ids) if p == 0]
    if n and starts[:1] != [0]:
        raise InvalidRequest(f"{where}.position_ids", "a packed row starts with position 0")
    bounds = list(zip(starts, starts[1:] + [n]))
    return [Sample(batch.input_ids[a:b], mask[a:b], batch.advantages[a:b], batch.inference_logprobs[a:b],
                   batch.temperatures[a:b], batch.env_names[a], f"{where}.input_ids[{a}:{b}]",
                   None if routes is None else routes[a:b]) for a, b in bounds]


def step_batch(micro_batches: list[MicroBatch], vocab_size: int | None = None, replay: bool = False) -> StepBatch:
    """Every micro-batch of a rank's step as sequences grouped by exact prompt, checked before any work; with
    `replay`, each sequence carries its routed experts."""
    out = StepBatch()
    groups: dict[tuple[int, ...], int] = {}
    for index, batch in enumerate(micro_batches):
        for sample in samples_of(batch, f"micro_batches[{index}]", replay):
            sequence, temperature = _sequence(sample, groups, vocab_size)
            if sequence is None:
                continue
            out.by_temperature.setdefault(temperature, []).append(sequence)
            out.samples += 1
            out.envs[sample.env_name] = out.envs.get(sample.env_name, 0) + 1
    return out


def _sequence(sample: Sample, groups: dict[tuple[int, ...], int], vocab_size: int | None):
    first = next((i for i, m in enumerate(sample.loss_mask) if m), None)
    if first is None:
        return None, None  # padding, a dummy row, or a sample with nothing to train
    if first == 0:
        raise InvalidRequest(sample.where, "its first token is trainable: a sample needs at least one prompt token")
    if vocab_size is not None:
        bad = next((t for t in sample.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(sample.where, f"token id {bad} is outside the model's vocabulary ({vocab_size})")
    temperatures = {t for t, m in zip(sample.temperatures, sample.loss_mask) if m}
    if len(temperatures) > 1:
        raise InvalidRequest(sample.where, f"its trainable tokens were sampled at several temperatures "
                             f"{sorted(temperatures)}: one per sample is supported")
    temperature = temperatures.pop()
    if not temperature > 0:
        raise InvalidRequest(sample.where, f"was sampled at temperature {temperature}: its log-probs are not a policy's")
    prompt = tuple(sample.token_ids[:first])
    group = groups.setdefault(prompt, len(groups))
    sequence = Sequence(prompt_ids=list(prompt), response_ids=sample.token_ids[first:], group_id=group,
                        advantages=sample.advantages[first:], behaviour_logprobs=sample.logprobs[first:],
                        loss_mask=[1.0 if m else 0.0 for m in sample.loss_mask[first:]],
                        routed_experts=None if sample.routes is None else Routes.of(sample.routes))
    sequence.check(sample.where)
    return sequence, temperature
