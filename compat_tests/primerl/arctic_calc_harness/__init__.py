"""A verifiers harness whose program is an in-process OpenAI chat loop with one local tool, `add`.

verifiers allows a harness to run its loop in-process rather than launch a program, as long as every
model call goes through the rollout's interception endpoint: then no uv script, container or network
is needed. The loop is a plain tool-calling agent: it sends the conversation, runs each tool call the
model makes, and stops at the first reply without one (or after `max_turns`).
"""

from __future__ import annotations

import asyncio
import json
import weakref

from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def openai_client(endpoint: str, secret: str) -> AsyncOpenAI:
    """A rollout's OpenAI client, on its event loop's one HTTP connection pool. An OpenAI client of its own per
    rollout builds an httpx client each time, and with it a TLS context (the CA bundle parsed) even for the plain
    http endpoint: a third of the env server's CPU in prime-rl's orchestrator runs."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = DefaultAsyncHttpxClient()
    return AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=_POOLS[loop])


def add(arguments: str) -> str:
    args = json.loads(arguments)
    return str(int(args["a"]) + int(args["b"]))


class CalcHarnessConfig(HarnessConfig):
    use_tools: bool = True
    max_turns: int = 3


class CalcHarness(Harness[CalcHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                     else [m.model_dump(exclude_none=True) for m in prompt])
        tools = {"tools": [ADD_TOOL]} if self.config.use_tools else {}
        client = openai_client(endpoint, secret)  # not closed: the pool it uses is the loop's
        for _ in range(self.config.max_turns):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages, **tools)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": add(call.function.arguments)})
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalcHarness", "openai_client"]
