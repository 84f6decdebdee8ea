"""Constrained replies on the OpenAI routes, as `vllm serve` makes them: `structured_outputs`, `response_format`
and a forced `tool_choice` (`required`, or a named function) become one `StructuredOutputs` constraint that the
sampler's grammar engine applies at each step; a forced tool choice's reply is read back as tool calls.

The JSON shapes are vLLM 0.32's (`vllm/tool_parsers/utils.py`, `get_json_schema_from_tools`, and its parsers'
`_extract_tool_calls`): `required` constrains the reply to a JSON array of `{"name", "parameters"}` objects, one
per call, each naming a tool and its parameters matching that tool's schema; a named function constrains it to
that function's parameters.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.serving.chat.protocol import NamedToolChoice

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def tool_schema(tools: list[dict[str, Any]], tool_choice: str | NamedToolChoice | None,
                parallel_tool_calls: bool | None) -> dict | None:
    """The JSON schema a forced tool choice puts on the reply; None where the choice forces nothing."""
    if tool_choice in (None, "none", "auto"):
        return None
    functions = {tool["function"]["name"]: tool["function"].get("parameters") or _EMPTY_OBJECT
                 for tool in tools if tool.get("type", "function") == "function"}
    if tool_choice == "required":
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
             "required": ["name", "parameters"]} for name, parameters in functions.items()]}}
        if parallel_tool_calls is False:  # only an explicit false: unset means parallel calls are allowed
            schema["maxItems"] = 1
        return schema
    return functions[tool_choice.function.name]


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | NamedToolChoice | None,
                constrained: bool) -> None:
    """A forced tool choice names tools the request gives, and is not combined with another constraint."""
    if tool_choice not in (None, "none") and not tools:
        raise InvalidRequest("tool_choice", "needs tools")
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"tools[{i}].function.name", "every tool is a function with a name")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {tool["function"]["name"] for tool in tools or []}:
            raise InvalidRequest("tool_choice.function.name", f"{name!r} is not one of the request's tools")
    if constrained and tool_choice not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice", "a forced tool choice is its own constraint: give it without "
                                            "structured_outputs or a JSON response_format")


def forced_calls(text: str, tool_choice: str | NamedToolChoice | None) -> list[dict]:
    """A forced tool choice's reply as OpenAI tool calls: a named function's arguments are the reply itself;
    `required`'s reply is the JSON array of calls. A reply that is not that (cut short by max_tokens) gives none."""
    if isinstance(tool_choice, NamedToolChoice):
        return [_call(tool_choice.function.name, text)] if text.strip() else []
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return []
    return [_call(c["name"], json.dumps(c.get("parameters"), ensure_ascii=False)) for c in calls]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
