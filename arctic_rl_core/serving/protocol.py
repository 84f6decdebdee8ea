"""What the request schemas of the OpenAI- and vLLM-compatible routes share, and how they become `SamplingParams`
(each route family's own schema is in its package's `protocol`).

Requests are parsed strictly: a parameter we do not know is refused, naming it,
and so is one we know but cannot honour unless it has its neutral value (an
empty `logit_bias`, say). A parameter that changes only presentation
(`skip_special_tokens`, `user`, `cache_salt`) is accepted. vLLM's own field
names and defaults are used (`vllm/entrypoints/openai/*/protocol.py`,
`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`), so its clients
and its request models talk to us unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import MAX_TOP_LOGPROBS, SESSION_ID_CHARS, SamplingParams

# Parameters accepted only at the value that leaves sampling as it is.
NEUTRAL: dict[str, Any] = {
    "suffix": "", "features": {}, "content_parts": [], "logits_processors": [], "thinking_token_budget": None,
    "prompt_logprob_token_ids": [], "logprob_token_ids": [], "extra_args": {},
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "reasoning_ended": None, "reasoning_parser_kwargs": None,
    # vLLM refuses these unless started with --trust-request-mm-kwargs; empty, they change nothing (text models)
    "media_io_kwargs": {}, "mm_processor_kwargs": {},
}


def _without_neutral(values: Any, where: str) -> Any:
    """`values` less the NEUTRAL parameters, each refused unless neutral."""
    if not isinstance(values, dict):
        return values
    for name, neutral in NEUTRAL.items():
        value = values.get(name)
        if value is None or value == neutral or value in ({}, []) and neutral in ({}, [], None):
            continue
        raise InvalidRequest(f"{where}{name}", f"is not supported by this server (only {neutral!r} is accepted)")
    return {k: v for k, v in values.items() if k not in NEUTRAL}


def parse_request(model: type[BaseModel], body: Any):
    """A request of `model` from a JSON body, its errors naming the parameter."""
    from arctic_rl_core.validation import parse

    body = _without_neutral(body, "")
    if isinstance(body, dict) and isinstance(body.get("sampling_params"), dict):
        body["sampling_params"] = _without_neutral(body["sampling_params"], "sampling_params.")
    return parse(model, body, "")


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsRequest(StrictRequest):
    """vLLM's `structured_outputs` (`StructuredOutputsParams`): one constraint on the reply."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    """A JSON schema (vLLM's `json`)."""
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    """xgrammar's structural tag, as JSON text (vLLM's)."""
    disable_fallback: Literal[False] = False
    disable_any_whitespace: Literal[False] = False
    disable_additional_properties: Literal[False] = False
    whitespace_pattern: None = None
    """vLLM's backend options: only at their defaults (this server lets vLLM choose the grammar backend)."""


class RepetitionDetectionRequest(StrictRequest):
    """vLLM's `repetition_detection`: `max_pattern_size` 0 turns it off; `min_pattern_size` 0 means 1."""

    max_pattern_size: int = Field(0, ge=0)
    min_pattern_size: int = Field(0, ge=0)
    min_count: int = Field(0, ge=0)

    def as_sampling(self) -> dict | None:
        if self.max_pattern_size == 0:
            return None
        return {"max_pattern_size": self.max_pattern_size, "min_pattern_size": self.min_pattern_size or 1,
                "min_count": self.min_count}


class JsonSchemaFormat(StrictRequest):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that a schema validates."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SampledRequest(StrictRequest):
    """What completions and chat requests share."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """vLLM's: -1 or 0 disables it."""
    seed: int | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_TOP_LOGPROBS)
    min_p: float = 0.0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs_of: Literal["model", "sampler"] = "sampler"
    """Ours (`SamplingParams.logprobs_of`): the sampled distribution's log-probs (the default: what `vllm serve`
    reports with processed log-probs, and the behaviour policy a session captures), or the model's own."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's: each choice carries its sampled `token_ids`, the response its `prompt_token_ids`."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: log-prob entries name tokens as "token_id:<id>" rather than as text."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    session_id: str | None = Field(None, min_length=1, max_length=SESSION_ID_CHARS)
    """Record the prompt and completions as a turn of this episode (also the `X-Session-Id` header)."""
    user: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_reasoning: bool = True
    """vLLM's: without a reasoning parser (this server has none) the reply has no reasoning to leave out."""
    repetition_detection: RepetitionDetectionRequest | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: the prompt's tokens (after templating) cut to this many, from `truncation_side`; -1: to the model's
    context (less one where a token budget is given)."""
    truncation_side: Literal["left", "right"] | None = None
    """`left` (the default, as vLLM's for generating models) keeps the prompt's last tokens, `right` its first."""
    stream_interval: int | None = Field(None, ge=1)
    """vLLM's: a stream's pieces carry this many tokens (the first piece as soon as it is sampled)."""
    routed_experts_prompt_start: int | None = Field(None, ge=0)
    """vLLM's: where a choice's `routed_experts` begin in the prompt (with router replay's R3 recording)."""
    # vLLM's, and taken as `vllm serve` takes them with its default flags, where they change nothing: first come,
    # first served scheduling (priority), no watermark configured, no KV or encoder-cache connector, no custom
    # logits processors (vllm_xargs), prompt offsets that no response carries, text models (mm_*).
    priority: int = 0
    watermarking: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    return_token_offsets: bool | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None

    def truncated(self, ids: list[int], max_context: int, budget_given: bool) -> list[int]:
        """The prompt's ids cut as `truncate_prompt_tokens` asks (vLLM's rules)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > max_context:
            raise InvalidRequest("truncate_prompt_tokens", f"is {keep}, over the model's context ({max_context} tokens)")
        if keep == -1:
            keep = max_context - 1 if budget_given else max_context
        if keep == 0:
            raise InvalidRequest("truncate_prompt_tokens", "0 leaves the prompt empty")
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint(self) -> dict | None:
        """`structured_outputs`, else a JSON `response_format`, as `StructuredOutputs` fields (vLLM's order of
        precedence); None where the reply is free."""
        so = self.structured_outputs
        if so is not None:
            given = {"json_schema": so.json_, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
                     "grammar": so.grammar, "structural_tag": so.structural_tag}
            return {name: value for name, value in given.items() if value is not None}
        form = self.response_format
        if form is None or form.type == "text":
            return None
        if form.type == "json_object":
            return {"json_object": True}
        if form.json_schema is None:
            raise InvalidRequest("response_format.json_schema", "is required with type json_schema")
        return {"json_schema": form.json_schema.schema_ or {}}

    def sampling(self, max_tokens: int, logprobs: int, constraint: dict | None = None) -> SamplingParams:
        """`constraint`: one that overrides the request's own (a forced tool choice's)."""
        values = {"n": self.n, "max_tokens": max_tokens, "stop": self.stops(), "stop_token_ids": self.stop_token_ids or [],
                  "seed": self.seed, "logprobs": logprobs, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                  "prompt_logprobs": None if self.prompt_logprobs is None else max(self.prompt_logprobs, 0),
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p,
                  "top_k": 0 if self.top_k in (None, -1) else self.top_k,
                  "structured_outputs": constraint or self.constraint()}
        return sampling_params_of({**values, **shaping(self)})


def shaping(request) -> dict:
    """The penalties, min_p, biases, allowed and banned tokens, repetition detection and whose log-probs, as
    `SamplingParams` names them (a null is the default)."""
    values = {"min_p": request.min_p, "logprobs_of": request.logprobs_of, "presence_penalty": request.presence_penalty,
              "frequency_penalty": request.frequency_penalty, "repetition_penalty": request.repetition_penalty,
              "logit_bias": request.logit_bias, "allowed_token_ids": request.allowed_token_ids,
              "bad_words": request.bad_words,
              "repetition_detection": request.repetition_detection and request.repetition_detection.as_sampling()}
    return {name: value for name, value in values.items() if value is not None}


def sampling_params_of(values: dict, where: str = "") -> SamplingParams:
    from arctic_rl_core.validation import parse

    return parse(SamplingParams, values, where.rstrip("."))
