"""The typed values that cross the training API.

Only plain data crosses: token ids, per-token float arrays, names and
numbers. No framework objects and no tensors, so the same types serve the
in-process backend and the HTTP client. A request's token ids and per-token
floats may be Python lists or 1-D numpy arrays: arrays are kept as they are
(never copied into lists), so a batch decoded from the wire, or handed over by
a framework from its tensors, reaches the engine as the same memory.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, SerializationInfo, WrapValidator, field_validator, model_validator

from arctic_rl_core.errors import InvalidRequest


MODEL_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size")
"""The Hugging Face config fields that must agree between a framework's model and the backend's."""


def model_shape(hf_config: dict) -> dict:
    """The defining shape of a model, from its Hugging Face config as a dict."""
    return {key: hf_config.get(key) for key in MODEL_SHAPE_KEYS}


MAX_VERSION = 2**53
"""Weight versions are counters; this bound keeps them exact as floats in the losses' arithmetic."""
MAX_LEARNING_RATE = 10.0
"""Far above any learning rate in use; larger ones overflow weights in a step."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a sampler reports per position (OpenAI's own cap on `top_logprobs`)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 1e2
"""Sampling and scoring temperatures divide the logits: outside this range they overflow fp16/bf16
logits or flatten the policy to noise. Temperature 0 (greedy) is allowed for sampling."""


def _array_or_list(kinds: str):
    def validate(value: Any, handler) -> Any:
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in kinds:
            return value
        # A list, or an array of another kind or shape: pydantic checks each element and names the bad one.
        return handler(value.tolist() if isinstance(value, np.ndarray) else value)
    return WrapValidator(validate)


def _as_json(value: Any, info: SerializationInfo) -> Any:
    # Python-mode dumps keep arrays, which the wire format sends as tensors without a copy.
    return value.tolist() if isinstance(value, np.ndarray) and info.mode_is_json() else value


TokenIds = Annotated[list[int], _array_or_list("iu"), PlainSerializer(_as_json)]
"""Token ids: a list of ints or a 1-D integer numpy array."""
TokenFloats = Annotated[list[float], _array_or_list("fiub"), PlainSerializer(_as_json)]
"""One float per response token: a list or a 1-D numeric numpy array."""


def token_list(values: Any) -> list:
    """The values as a Python list, for libraries that take only lists (vLLM's prompts)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def joined(prompt: Any, response: Any) -> np.ndarray:
    """Prompt then response tokens as one int64 array."""
    return np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(response, dtype=np.int64)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


class RoutedExperts(_Strict):
    """The experts each token of a sequence was routed to, per mixture-of-experts layer (router replay, R3/R2;
    docs/losses.md): `[tokens, layers, top_k]` expert ids, flattened in that order so the whole record travels as
    one integer array. Tokens are the prompt's then the response's, from the first. A record may stop short of the
    sequence's end, not before the position that predicts its last trained token (vLLM forwards every token but the
    last sampled one, whose output no log-prob reads): tokens past it route natively. `layers` is the
    model's decoder layer count (`num_hidden_layers`), the axis its absolute index; a dense layer's rows are
    ignored."""

    ids: TokenIds
    layers: int = Field(ge=1)
    top_k: int = Field(ge=1)

    @property
    def tokens(self) -> int:
        return len(self.ids) // (self.layers * self.top_k)

    def array(self) -> np.ndarray:
        """[tokens, layers, top_k] int64."""
        return np.asarray(self.ids, dtype=np.int64).reshape(-1, self.layers, self.top_k)

    @classmethod
    def of(cls, routes: np.ndarray) -> "RoutedExperts":
        """From a [tokens, layers, top_k] integer array, in the narrowest unsigned type that holds it (uint8 up to
        256 experts), which the wire format keeps."""
        routes = np.asarray(routes)
        top = int(routes.max()) if routes.size else 0
        if routes.size and routes.min() < 0:
            dtype = np.int64  # refused by the model's check, named there
        else:
            dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.int64
        return cls(ids=routes.reshape(-1).astype(dtype), layers=routes.shape[1], top_k=routes.shape[2])


class Sequence(_Strict):
    """One prompt + response to train on or score.

    Per-token arrays cover the response only: entry i belongs to
    `response_ids[i]`. Log-probs are of the token itself (not shifted).
    """

    prompt_ids: TokenIds
    response_ids: TokenIds
    group_id: str | int | None = None
    """GRPO group: sequences with the same id share their prompt."""
    advantages: TokenFloats | None = None
    behaviour_logprobs: TokenFloats | None = None
    """Log-probs under the policy that sampled the response."""
    behaviour_version: int | None = Field(None, ge=0, le=MAX_VERSION)
    """The weight version that produced `behaviour_logprobs`."""
    behaviour_versions: TokenIds | None = None
    """Per response token, the weight version that sampled it and its behaviour log-prob: for a response sampled
    across a weight sync (`Completion.token_versions`). Give this or `behaviour_version`, not both."""
    proximal_logprobs: TokenFloats | None = None
    """Recomputed proximal-policy log-probs for decoupled (off-policy) losses."""
    ref_logprobs: TokenFloats | None = None
    is_weights: TokenFloats | None = None
    """Importance weights the caller computed (verl's rollout correction: truncated pi_old / pi_rollout); each
    token's policy-gradient term is multiplied by its weight. Only a loss that reads them accepts them."""
    returns: TokenFloats | None = None
    """The critic's regression targets (e.g. GAE's advantages + values), for the `value` loss."""
    old_values: TokenFloats | None = None
    """The critic's values when the batch was scored, the centre of the `value` loss's clip."""
    loss_mask: TokenFloats | None = None
    """1 to train on a response token, 0 to ignore it. Default: all ones."""
    routed_experts: RoutedExperts | None = None
    """The experts the sampler (R3) or an earlier log-prob pass (R2) routed each token to: with `router_replay`,
    every trainer forward over this sequence routes its tokens so (docs/losses.md)."""

    PER_TOKEN_FIELDS: ClassVar[tuple[str, ...]] = ("advantages", "behaviour_logprobs", "proximal_logprobs", "ref_logprobs",
                                                   "is_weights", "returns", "old_values", "loss_mask")

    def check(self, where: str) -> None:
        """Raise `InvalidRequest` naming the field if this sequence is inconsistent."""
        for name in ("prompt_ids", "response_ids"):
            ids = np.asarray(getattr(self, name))
            if not ids.size:
                raise InvalidRequest(f"{where}.{name}", "must hold at least one token")
            if ids.min() < 0:
                raise InvalidRequest(f"{where}.{name}", "token ids must be >= 0")
        n = len(self.response_ids)
        for name in self.PER_TOKEN_FIELDS:
            if getattr(self, name) is None:
                continue
            values = np.asarray(getattr(self, name))
            if len(values) != n:
                raise InvalidRequest(
                    f"{where}.{name}", f"has {len(values)} entries but response_ids has {n}"
                )
            finite = np.isfinite(values)
            if not finite.all():
                bad = int(np.argmin(finite))
                raise InvalidRequest(f"{where}.{name}[{bad}]", f"is {values[bad]}, must be finite")
        if self.behaviour_versions is not None:
            if self.behaviour_version is not None:
                raise InvalidRequest(f"{where}.behaviour_versions", "give behaviour_version or behaviour_versions, not both")
            if len(self.behaviour_versions) != n:
                raise InvalidRequest(f"{where}.behaviour_versions",
                                     f"has {len(self.behaviour_versions)} entries but response_ids has {n}")
            versions = np.asarray(self.behaviour_versions)
            if versions.size and (versions.min() < 0 or versions.max() > MAX_VERSION):
                raise InvalidRequest(f"{where}.behaviour_versions", f"versions must be in [0, {MAX_VERSION}]")
        if self.behaviour_logprobs is not None and np.max(self.behaviour_logprobs) > 1e-4:
            raise InvalidRequest(f"{where}.behaviour_logprobs", "log-probs must be <= 0")
        for name in ("loss_mask", "is_weights"):
            if getattr(self, name) is not None and np.min(getattr(self, name)) < 0:
                raise InvalidRequest(f"{where}.{name}", "must be >= 0")
        if self.routed_experts is not None:
            routes, tokens = self.routed_experts, len(self.prompt_ids) + n
            if len(routes.ids) % (routes.layers * routes.top_k):
                raise InvalidRequest(f"{where}.routed_experts.ids", f"has {len(routes.ids)} ids, not a whole number of "
                                     f"tokens of {routes.layers} layers x {routes.top_k} experts")
            trained = np.flatnonzero(np.asarray(self.loss_mask)) if self.loss_mask is not None else [n - 1]
            needed = len(self.prompt_ids) + (int(trained[-1]) if len(trained) else 0)
            if not needed <= routes.tokens <= tokens:
                raise InvalidRequest(f"{where}.routed_experts", f"routes {routes.tokens} tokens; the sequence has {tokens}, "
                                     f"and its trained tokens' log-probs read the first {needed}")


class ProcessorSpec(_Strict):
    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class LossSpec(_Strict):
    """Which registered loss to use, its config, and post-processors applied to the logits first."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    post: list[ProcessorSpec] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _by_name(cls, value: Any) -> Any:
        """A bare name is the loss with its default config: `fwd_bwd(seqs, "grpo")`."""
        return {"name": value} if isinstance(value, str) else value


Role = Literal["policy", "critic"]
"""The trainable models of a job: the policy, and the critic (`critic.enable`) for value-based advantages."""


class FwdBwdRequest(_Strict):
    sequences: list[Sequence]
    loss: LossSpec
    return_logprobs: bool = False
    """Return each response token's log-prob from the same forward (a framework's metrics need no second one)."""
    with_entropy: bool = False
    model: Role = "policy"


class ValuesRequest(_Strict):
    sequences: list[Sequence]


class ValuesResult(_Strict):
    values: list[list[float]]
    """Per sequence, the critic's value of each response token's state (the sequence up to that token)."""


class RoleRequest(_Strict):
    model: Role = "policy"


class FwdBwdResult(_Strict):
    loss: float
    metrics: dict[str, float]
    num_tokens: int
    """Response tokens with a non-zero loss mask."""
    num_sequences: int
    computed_tokens: int
    """Positions the model ran, padding included: with ZoRRo each shared prompt counts once."""
    weight_version: int
    logprobs: list[list[float]] | None = None
    """With `return_logprobs`: per sequence, each response token's log-prob (after the loss's post-processors)
    under the weights the gradients were taken at, as `log_probs` would give them."""
    entropy: list[list[float]] | None = None
    values: list[list[float]] | None = None
    """With `model="critic"`: per sequence, each response token's value from the same forward."""


MAX_WEIGHT_DECAY = 100.0
"""Far above any weight decay in use (AdamW's are 0 to 0.1)."""

_Beta = Annotated[float, Field(ge=0, lt=1)]


class AdamSettings(_Strict):
    """One optimizer step's AdamW settings, as Tinker's `AdamParams` come with every step; a field left out is the
    job's (`engine.betas`, `eps`, `weight_decay`, `grad_clip`). Set before each step: nothing carries over to the
    next, and a step without them is the job's."""

    betas: tuple[_Beta, _Beta] | None = None
    eps: float | None = Field(default=None, gt=0, le=1)
    weight_decay: float | None = Field(default=None, ge=0, le=MAX_WEIGHT_DECAY)
    grad_clip: float | None = Field(default=None, ge=0)
    """The gradients' largest global norm; 0 clips nothing."""


class StepRequest(_Strict):
    learning_rate: float | None = Field(default=None, ge=0, le=MAX_LEARNING_RATE)
    """0 is a step that moves no weight but advances the optimizer's state (a warm-up schedule's first step)."""
    adam: AdamSettings | None = None
    model: Role = "policy"


class StepResult(_Strict):
    step: int
    """Optimizer steps taken so far."""
    grad_norm: float
    learning_rate: float


MAX_CONSTRAINT_CHARS = 65536
"""A structured-outputs constraint's text (a JSON schema, a regex, a grammar, the choices together): its grammar is
compiled before the first token, so its size is capped as any request's work."""


class RepetitionDetection(_Strict):
    """vLLM's `RepetitionDetectionParams`: a completion whose last tokens are one pattern of `min_pattern_size` to
    `max_pattern_size` tokens repeated `min_count` times in a row ends there, finish reason `repetition` (its
    tokens kept): a degenerate rollout stops instead of filling its budget."""

    max_pattern_size: int = Field(ge=1)
    min_pattern_size: int = Field(default=1, ge=1)
    min_count: int = Field(ge=2)

    @model_validator(mode="after")
    def _sizes(self) -> "RepetitionDetection":
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(f"min_pattern_size ({self.min_pattern_size}) must not exceed max_pattern_size "
                             f"({self.max_pattern_size})")
        return self


class StructuredOutputs(_Strict):
    """Constrained decoding, as vLLM's `StructuredOutputsParams`: at each step the sampler masks the tokens the
    constraint does not allow (vLLM's grammar engine, xgrammar). Exactly one constraint. The distribution sampled
    from is the masked one, renormalised: that is what `logprobs_of: sampler` reports and a session captures as the
    behaviour policy; the model's own log-probs (the trainer's, `logprobs_of: model`) weigh the unmasked one."""

    json_schema: dict[str, Any] | str | None = None
    """A JSON schema, as an object or its text: the completion is a JSON value it validates (vLLM's `json`)."""
    json_object: bool = False
    """The completion is a JSON object (any)."""
    regex: str | None = Field(default=None, min_length=1)
    """The completion matches this regular expression."""
    choice: list[str] | None = Field(default=None, min_length=1)
    """The completion is one of these strings."""
    grammar: str | None = Field(default=None, min_length=1)
    """The completion is a sentence of this EBNF grammar (xgrammar's, GBNF-like)."""
    structural_tag: str | None = Field(default=None, min_length=1)
    """xgrammar's structural tag, as JSON text: free text where tags (a tool call's `<tool_call>`, say) are
    constrained between their begin and end (vLLM's `structural_tag`; what its tool-call parsers put on a reply)."""

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputs":
        given = [name for name in ("json_schema", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json_schema, json_object, regex, choice, grammar, structural_tag "
                             f"(got {given or 'none'})")
        schema = self.json_schema
        text = schema if isinstance(schema, str) else json.dumps(schema) if schema is not None else \
            "".join(self.choice) if self.choice is not None else self.regex or self.grammar or self.structural_tag or ""
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the constraint's {given[0]} has {len(text)} characters, over {MAX_CONSTRAINT_CHARS}")
        return self


class SamplingParams(_Strict):
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=MAX_TEMPERATURE)
    """0 is greedy; otherwise at least MIN_TEMPERATURE."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    """0 disables top-k."""
    max_tokens: int = Field(default=64, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    """Stop tokens (EOS, `stop_token_ids`) are not sampled before this many tokens (vLLM's `min_tokens`)."""
    ignore_eos: bool = False
    """Sampling goes on past the model's end-of-sequence token (vLLM's `ignore_eos`); `stop_token_ids` still stop
    it. The log-probs are unchanged: the token is sampled as the model weighs it, only not taken as the end."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Tokens less likely than `min_p` times the most likely one are not sampled (0: off)."""
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    """Subtracted from the logit of every token the completion already holds (vLLM's, OpenAI's)."""
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    """Subtracted from a token's logit once per time the completion already holds it."""
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    """A token of the prompt or the completion has its logit divided by this where positive, multiplied where not
    (vLLM's, Hugging Face's); 1 is off. Penalties apply before the temperature."""
    logprobs_of: Literal["model", "sampler"] = "model"
    """Whose log-probs a completion reports. `model`: the model's own at the temperature (what the trainer computes
    with the `apply_temperature` post-processor), whatever truncated or penalised the sampling; where a sampler
    cannot give them (truncation, `min_p`, `min_tokens` or penalties at a temperature other than 0 or 1 on vLLM)
    the request is refused by name. `sampler`: the distribution the tokens were drawn from, after penalties,
    temperature, `min_tokens`' mask and truncation, renormalised (vLLM's processed log-probs): the behaviour
    policy as it was, for an importance ratio against the model's."""
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    """How many most likely tokens to report at each sampled position, besides the sampled one
    (`Completion.top_logprobs`); 0 reports the sampled token's log-prob only."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Score the prompt too (`Completion.prompt_logprobs`): each prompt token's log-prob and this many
    most likely alternatives; None scores nothing."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the completion (a JSON schema, a regex, choices, a grammar); None: unconstrained."""
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] = Field(default_factory=dict)
    """Added to these tokens' logits before sampling (OpenAI's, token id -> -100 to 100)."""
    allowed_token_ids: list[int] = Field(default_factory=list)
    """Only these tokens are sampled (vLLM's); empty: every token."""
    bad_words: list[str] = Field(default_factory=list)
    """Never sampled (vLLM's: a word's tokens are blocked once its other tokens precede)."""
    repetition_detection: RepetitionDetection | None = None
    """End a completion that repeats a pattern (vLLM's); None: never."""
    adapter: str | None = Field(default=None, min_length=1, max_length=256)
    """Sample with this LoRA adapter on the sampler's base model: one the server gave the sampler (a Tinker
    tenant's saved weights, `sampler.adapters`); None: the sampler's weights alone."""

    @model_validator(mode="after")
    def _temperature(self) -> "SamplingParams":
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError("n must be 1 with temperature 0: greedy samples of one prompt are all the same")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def reshaped_by(self) -> str | None:
        """The first parameter that makes the sampled distribution other than the model's at the temperature
        (truncation, `min_p`, `min_tokens`' mask, a penalty, a structured-outputs constraint, a logit bias, allowed
        or banned tokens); None where it is the model's."""
        greedy = self.temperature == 0  # greedy ignores truncation
        for name, value, neutral in (("top_p", self.top_p, 1.0), ("top_k", self.top_k, 0), ("min_p", self.min_p, 0.0)):
            if not greedy and value != neutral:
                return name
        for name in ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words"):
            if getattr(self, name):
                return name
        for name, value, neutral in (("min_tokens", self.min_tokens, 0), ("presence_penalty", self.presence_penalty, 0.0),
                                     ("frequency_penalty", self.frequency_penalty, 0.0),
                                     ("repetition_penalty", self.repetition_penalty, 1.0)):
            if value != neutral:
                return name
        return None


SESSION_ID_CHARS = 256


class GenerateRequest(_Strict):
    prompts: list[TokenIds]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    session: str | None = Field(default=None, min_length=1, max_length=SESSION_ID_CHARS)
    """Record each prompt and its completions as turns of this episode (`episode`)."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _default_sampling(cls, value: Any) -> Any:
        return {} if value is None else value


def behaviour(sampled: "Completion | Turn") -> dict[str, Any]:
    """The fields of a training `Sequence` that say how its response was sampled: log-probs, version(s) and, where
    the sampler recorded it, the routing (R3)."""
    versions = ({"behaviour_versions": sampled.token_versions} if sampled.token_versions
                else {"behaviour_version": sampled.weight_version})
    routes = {"routed_experts": sampled.routed_experts} if getattr(sampled, "routed_experts", None) is not None else {}
    return {"behaviour_logprobs": sampled.logprobs, **versions, **routes}


class Completion(_Strict):
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the temperature-scaled policy."""
    finish_reason: Literal["stop", "length", "abort", "repetition"]
    """`abort`: the generation was cut short (`abort_generation`, the serving routes' `/pause`); its tokens
    are what was sampled until then, with their log-probs."""
    weight_version: int
    """The version that sampled its first token (the oldest of its tokens')."""
    token_versions: list[int] | None = None
    """Where a weight sync crossed the request: per token, the version that sampled it (and its log-prob); None
    when `weight_version` sampled every token."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With `sampling.logprobs` = k: at each sampled position, the k most likely (token id, log-prob)."""
    ranks: list[int] | None = None
    """Each sampled token's rank in the distribution its log-prob is of (1: the most likely), as vLLM reports it;
    None where the sampler does not say."""
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    """With `sampling.prompt_logprobs` = k: for prompt tokens 1.. (the first has no context), the token's own
    (id, log-prob) first, then the k most likely."""
    routed_experts: RoutedExperts | None = None
    """With `router_replay: R3` on a mixture-of-experts model: the experts the sampler routed the prompt and every
    sampled token but the last to (`Sequence.routed_experts`)."""


class Turn(_Strict):
    """One sampled completion of an episode, exactly as the sampler saw and produced it."""

    prompt_ids: list[int]
    """The prompt's token ids as rendered and sampled from (never re-tokenised)."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort", "repetition"]
    weight_version: int
    token_versions: list[int] | None = None
    """As `Completion.token_versions`."""
    routed_experts: RoutedExperts | None = None
    """As `Completion.routed_experts` (R3)."""
    cancelled: bool = False
    """The client went away (disconnected, timed out) before the answer: `token_ids` are exactly the tokens it was
    sent (none for a reply it never received), and the sampler stopped there. Such a turn trains as the truncated
    turn it was: every token the agent saw, with its behaviour log-prob (`Episode.sequences`)."""


class EpisodeRequest(_Strict):
    session: str = Field(min_length=1, max_length=SESSION_ID_CHARS)
    release: bool = False
    """Forget the episode once returned (the server keeps captured episodes until released or evicted)."""


class Episode(_Strict):
    session: str
    turns: list[Turn]

    def sequences(self, advantages: float | list[float] = 0.0, group_id: str | int | None = None) -> list[Sequence]:
        """The turns as training sequences: sampled tokens with their behaviour log-probs and version, and
        one advantage for the episode or one per turn, in group `group_id` (default: the session). Turns whose
        prompts extend earlier turns share those tokens, which ZoRRo's prefix forest computes once."""
        per_turn = advantages if isinstance(advantages, list) else [advantages] * len(self.turns)
        if len(per_turn) != len(self.turns):
            raise InvalidRequest("advantages", f"has {len(per_turn)} entries but the episode has {len(self.turns)} turns")
        return [Sequence(prompt_ids=t.prompt_ids, response_ids=t.token_ids, group_id=self.session if group_id is None else group_id,
                         advantages=[float(a)] * len(t.token_ids), **behaviour(t))
                for t, a in zip(self.turns, per_turn) if t.token_ids]


class LogProbsRequest(_Strict):
    sequences: list[Sequence]
    with_entropy: bool = False
    temperature: float = Field(default=1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)
    source: Literal["trainer", "sampler", "reference"] = "trainer"
    """Whose log-probs: the trainer's current weights, the sampler's, or the job's frozen reference model."""


class LogProbsResult(_Strict):
    logprobs: list[list[float]]
    """Per sequence, the log-prob of each response token."""
    entropy: list[list[float]] | None = None
    weight_version: int
    routed_experts: list[RoutedExperts] | None = None
    """With `router_replay` on a mixture-of-experts model (trainer log-probs): per sequence, the experts this
    forward routed each token to, replayed or its own. R2 trains on the old-policy pass's: give them back as
    `Sequence.routed_experts`."""


class CheckpointInfo(_Strict):
    path: str
    step: int
    weight_version: int
