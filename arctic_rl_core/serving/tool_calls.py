"""Tool calls out of chat replies by vLLM's own parsers (`arctic-rl serve --tool-call-parser NAME`: any name
`vllm serve --tool-call-parser` takes, e.g. `hermes` for Qwen's and Hermes' templates).

A request with tools goes through the parser as `vllm serve` (with `--enable-auto-tool-choice`) puts it: the
parser adjusts the request (vLLM's strict tool calling: an xgrammar structural tag that constrains each call to
the parser's own format and the tool's schema, for `required`, a named function, `parallel_tool_calls: false`
and tools marked `strict`; the reply's special tokens kept for the parser to read), then reads each reply, whole
or as it streams, into content and tool calls. Parsing changes only the message: the sampled token ids, and what
a session captures, are the same either way.
"""

from __future__ import annotations

from typing import Any

from arctic_rl_core.serving.chat.protocol import ChatCompletionRequest, NamedToolChoice


def parser_class(name: str, tokenizer) -> type:
    """vLLM's parser of `name` (a tool parser composed as `vllm serve` composes it), checked against the served
    model's tokenizer; ValueError, naming the flag, where vLLM is not installed or has no parser of that name."""
    try:
        from vllm.parser import ParserManager
        from vllm.tool_parsers import ToolParserManager
    except ImportError as err:
        raise ValueError(f"--tool-call-parser uses vLLM's parsers, and vLLM is not installed ({err}): "
                         "pip install 'arctic-rl[vllm]'") from None
    if name not in ToolParserManager.list_registered():
        raise ValueError(f"--tool-call-parser {name!r} is not one of vLLM's: "
                         f"{', '.join(ToolParserManager.list_registered())}")
    try:
        return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tool_strict_level="auto",
                                        tokenizer=tokenizer)
    except TypeError as err:  # the tokenizer lacks what the parser reads (its markers' tokens)
        raise ValueError(str(err)) from None


def as_rendered(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as `vllm serve` hands them to the chat template: each through vLLM's request model, so that the
    prompt is the one production serving renders (a function without a description shows `"description": null`
    to the template). As given where vLLM is not installed."""
    if not tools:
        return tools
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    except ImportError:
        return tools
    from arctic_rl_core.validation import parse

    return [parse(ChatCompletionToolsParam, tool, f"tools[{i}]").model_dump() for i, tool in enumerate(tools)]


class ToolCalls:
    """One chat request's tool calling: the request as vLLM's parser adjusts it, then each choice's reply read
    into content and calls (`parse`, or a `stream()` per choice)."""

    def __init__(self, parser_class_: type, tokenizer, req: ChatCompletionRequest):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        from arctic_rl_core.validation import parse

        body = req.model_dump(by_alias=True, exclude_none=True, include={
            "messages", "tools", "tool_choice", "parallel_tool_calls", "structured_outputs", "response_format",
            "skip_special_tokens", "include_reasoning"})
        request = parse(VllmRequest, body, "")
        self._new = lambda: parser_class_(tokenizer, request.tools)
        if request.tool_choice != "none":  # vLLM's renderer adjusts a request unless its tools are not to be called
            request = self._new().adjust_request(request)
        self.request = request
        self.named = isinstance(req.tool_choice, NamedToolChoice)

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the reply's text drops special tokens (the parser may keep them: its markers can be ones)."""
        return self.request.skip_special_tokens

    def constraint(self) -> dict | None:
        """The constraint on the reply (`StructuredOutputs` fields) once the parser adjusted the request: its
        structural tag, or the request's own; None where the reply is free."""
        so = self.request.structured_outputs
        if so is None:
            return None
        given = {"json_schema": so.json, "json_object": so.json_object, "regex": so.regex, "choice": so.choice,
                 "grammar": so.grammar, "structural_tag": so.structural_tag}
        return {name: value for name, value in given.items() if value is not None} or None

    def parse(self, text: str, token_ids: list[int], finish_reason: str) -> tuple[str | None, list[dict], str]:
        """A whole reply's (content, calls, finish reason), as `vllm serve` answers them."""
        from vllm.renderers.chat_utils import make_tool_call_id

        _, content, calls = self._new().parse(text, self.request, enable_auto_tools=True,
                                              model_output_token_ids=token_ids)
        calls = [{"id": getattr(call, "id", None) or make_tool_call_id(), "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}} for call in calls or []]
        if self.request.parallel_tool_calls is False:
            calls = calls[:1]
        if self.request.tool_choice == "required" or self.named:
            content = content or ""  # a forced choice's content is never null
        elif calls:
            finish_reason = "tool_calls"
        if self.request.tool_choice == "required" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def stream(self, prompt_ids: list[int]) -> "ToolCallStream":
        return ToolCallStream(self, self._new(), prompt_ids)


class ToolCallStream:
    """One choice's reply read as it streams: each piece's delta (content and call fragments, in vLLM's chunk
    shape), None where the parser holds text back (a call's marker it has not seen whole)."""

    def __init__(self, calls: ToolCalls, parser, prompt_ids: list[int]):
        self._calls, self._parser, self._prompt_ids = calls, parser, prompt_ids
        self.called = False

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        message = self._parser.parse_delta(text, list(token_ids), self._calls.request, self._prompt_ids,
                                           finished=finished)
        if message is None:
            return None
        if message.tool_calls:
            self.called = True
        delta = message.model_dump(exclude_unset=True, exclude_none=False)
        if self._calls.request.parallel_tool_calls is False and delta.get("tool_calls"):
            delta["tool_calls"] = [call for call in delta["tool_calls"] if call.get("index") == 0]
        delta.pop("reasoning", None)  # no reasoning parser here
        return delta

    def finish_reason(self, engine_reason: str) -> str:
        """vLLM's: `tool_calls` where a call was streamed and the engine stopped, unless a named function was
        forced (that one ends as `stop`)."""
        return "tool_calls" if self.called and not self._calls.named and engine_reason == "stop" else engine_reason

