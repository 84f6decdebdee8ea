"""`/v1/chat/completions`' request schema (vLLM's field names and defaults), tool choice included."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from arctic_rl_core.serving.protocol import SampledRequest, StrictRequest
from arctic_rl_core.types import MAX_TOP_LOGPROBS


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SampledRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    continue_final_message: bool = False
    """vLLM's: the reply continues the last message (rendered open, without its end), with
    `add_generation_prompt: false`."""
    documents: list[dict[str, str]] | None = None
    """vLLM's: documents for the chat template (retrieval-augmented templates render them)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """vLLM's: a chat template variable, with `enable_thinking` (false for "none") unless the request's
    `chat_template_kwargs` set it."""
    echo: bool = False
    """vLLM's: the prompt's log-probs are returned, and where the last message is the reply's role its content
    comes before each reply's."""
    return_prompt_text: bool = False
    """vLLM's: the rendered prompt's text in the response (`prompt_text`)."""

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: `chat_template_kwargs`, and `reasoning_effort` as vLLM passes it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    """Tools are rendered into the prompt by the chat template. `auto`: the server's `--tool-call-parser` (if any)
    reads calls out of the reply; `required` or a named function: the reply is constrained to calls
    (`serving.constraints`), as `vllm serve` does."""
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
