"""The token routes' request schemas: vLLM 0.32's `/inference/v1/generate` (token in, token out), `/tokenize` and
`/detokenize`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from arctic_rl_core.serving.protocol import (
    RepetitionDetectionRequest,
    StreamOptions,
    StrictRequest,
    sampling_params_of,
    shaping,
)
from arctic_rl_core.types import MAX_TOP_LOGPROBS, SESSION_ID_CHARS, SamplingParams


class TokenSamplingParams(StrictRequest):
    """vLLM's `SamplingParams` as `/inference/v1/generate` takes them (its defaults)."""

    n: int = Field(1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs_of: Literal["model", "sampler"] = "sampler"
    """Ours, as the chat and completions routes' `logprobs_of`."""
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    repetition_detection: RepetitionDetectionRequest | None = None
    logprobs: int | None = Field(None, ge=-1, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_TOP_LOGPROBS)
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int | None = None
    stream_interval: int | None = None
    skip_clone: bool | None = None
    output_text_buffer_length: int | None = None
    skip_reading_prefix_cache: bool | None = None
    routed_experts_prompt_start: int | None = None
    trace_decode_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    """These two prime-rl's orchestrator puts in every policy request's `sampling_params`, where vLLM's
    `SamplingParams` drops them as unknown keys: this route returns token ids whatever the first says, and the
    sampler's prefix cache never outlives a weight version, which is what the salt is for."""


class TokenGenerateRequest(StrictRequest):
    """vLLM 0.32's `GenerateRequest` (token in, token out): the route SkyRL and PrimeRL train from."""

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    sampling_params: TokenSamplingParams
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    session_id: str | None = Field(None, min_length=1, max_length=SESSION_ID_CHARS)
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    """As the chat and completions routes take them: no effect under this server's scheduling, with no connector."""
    return_sample_support: bool = False
    """SkyRL's (`/skyrl/v1/generate`): refused, as the sample support replay it serves."""

    def sampling(self, max_tokens: int) -> SamplingParams:
        sp = self.sampling_params
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        return sampling_params_of({"n": sp.n, "temperature": sp.temperature, "top_p": sp.top_p,
                          "top_k": 0 if sp.top_k == -1 else sp.top_k, "seed": sp.seed, "stop": stops,
                          "stop_token_ids": sp.stop_token_ids or [], "max_tokens": max_tokens,
                          "min_tokens": sp.min_tokens, "ignore_eos": sp.ignore_eos,
                          "logprobs": max(sp.logprobs or 0, 0),
                          "prompt_logprobs": None if sp.prompt_logprobs is None else max(sp.prompt_logprobs, 0),
                          **shaping(sp)},
                         "sampling_params.")


class TokenizeRequest(StrictRequest):
    """vLLM's `/tokenize`: a text prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template writes its own)."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]
