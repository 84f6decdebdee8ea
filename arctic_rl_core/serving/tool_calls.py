"""Tool calls out of a chat reply, as vLLM's `--tool-call-parser` does (`arctic-rl serve --tool-call-parser`).

`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of Qwen's and
Hermes' chat templates. A block that is not valid JSON with a name stays in the content, as vLLM's parser
leaves it. Parsing changes only the message: the sampled token ids (and what a session captures) are the
same either way.
"""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """The reply's content without its well-formed calls, and the calls in OpenAI's shape."""
    calls, kept, at = [], [], 0
    for match in _HERMES.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
            "name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[at:match.start()])
        at = match.end()
    kept.append(text[at:])
    return "".join(kept).strip(), calls
