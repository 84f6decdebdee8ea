"""`/v1/completions`'s request schema (vLLM's field names and defaults)."""

from __future__ import annotations

from pydantic import Field

from arctic_rl_core.serving.protocol import SampledRequest
from arctic_rl_core.types import MAX_TOP_LOGPROBS


class CompletionRequest(SampledRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    """0 only with `echo`: the prompt back, and its log-probs, with nothing sampled (as vLLM)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True
    echo: bool | None = False
    """The prompt's text before each choice's; with `logprobs`, the prompt's log-probs before the completion's
    (the first prompt token's null: it has no context)."""
    best_of: int | None = None
    """Accepted and not applied, as by vLLM 0.32, whose engine has no best-of sampling: each of the `n` choices is
    one sample."""
