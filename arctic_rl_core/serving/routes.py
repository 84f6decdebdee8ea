"""The OpenAI- and vLLM-compatible routes, on the job's own sampler, weights and episode capture, by family as vLLM
splits its serving code:

- `completions`: `/v1/completions`; `chat`: `/v1/chat/completions` (OpenAI's schema, vLLM's extensions), streamed as
  server-sent events on request;
- `tokens`: `/inference/v1/generate`, vLLM 0.32's token-in, token-out route (SkyRL's and PrimeRL's rollouts), and
  `/tokenize`, `/detokenize`;
- `control`: `/v1/models`, `/health`, `/metrics` (the engines' Prometheus metrics, vLLM's names), and the RL control
  routes `/pause`, `/resume`, `/is_paused`, `/update_weights` (the job's `sync_weights`), `/weight_info`,
  `/get_world_size`.

The request path they share is `request_path`. Every completion reports the weight version that sampled it as vLLM's
`weight_versions` spans. A request naming a session (`session_id`, or the `X-Session-Id` header) records its prompt's
token ids and its completions as turns of that episode, which the training API's `episode` call returns.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.serving import control
from arctic_rl_core.serving.chat import routes as chat
from arctic_rl_core.serving.chat.protocol import ChatCompletionRequest
from arctic_rl_core.serving.coalesce import Coalescer
from arctic_rl_core.serving.completions import routes as completions
from arctic_rl_core.serving.handoff import Handoff
from arctic_rl_core.serving.pause import PauseGate
from arctic_rl_core.serving.request_path import RequestPath
from arctic_rl_core.serving.text import TextCodec
from arctic_rl_core.serving.tokens import routes as tokens
from arctic_rl_core.serving.tool_calls import ToolCalls, parser_class
from arctic_rl_core.types import Completion, SamplingParams


@dataclass
class Serving:
    """The serving surface's state on one server."""

    served_model_name: str | None
    tool_call_parser: str | None = None
    """A vLLM tool parser's name (`hermes`, ...): chat replies to requests with `tools` are read into the message's
    `tool_calls` by it, and constrained to its format as `vllm serve` constrains them (`serving.tool_calls`)."""
    gate: PauseGate = field(default_factory=PauseGate)
    frozen: Any = None
    """The job whose sampler `/pause?mode=keep` froze, until `/resume`."""
    requests: dict[str, int] = field(default_factory=lambda: {"completions": 0, "chat": 0, "generate": 0})
    cancelled: int = 0
    """Requests whose client went away before their answer: each was ended in the sampler where it can."""
    max_concurrent: int = 64
    """Requests sampling at once on a continuously batched sampler (the server's connection cap)."""
    _codec: tuple[Any, TextCodec] | None = None
    _tool_parser: tuple[TextCodec, type] | None = None
    _coalescer: tuple[Any, Coalescer] | None = None
    _callers: ThreadPoolExecutor | None = None
    _direct_calls: int = 0
    _handoff: Handoff | None = None

    def handoff(self) -> Handoff:
        """The running event loop's: streams' tokens from the engine's thread."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = Handoff(loop)
        return self._handoff

    def codec(self, api) -> TextCodec:
        if self._codec is None or self._codec[0] is not api:
            self._codec = (api, TextCodec(api.config.model_path))
        return self._codec[1]

    def tool_calls(self, api, req: ChatCompletionRequest) -> ToolCalls | None:
        """The request's tool calling through the server's parser; None without a parser, tools, or where tools are
        not to be called."""
        if self.tool_call_parser is None or not req.tools or req.tool_choice == "none":
            return None
        codec = self.codec(api)
        if self._tool_parser is None or self._tool_parser[0] is not codec:
            self._tool_parser = (codec, parser_class(self.tool_call_parser, codec.tokenizer))
        return ToolCalls(self._tool_parser[1], codec.tokenizer, req)

    def generate(self, api, executor, prompts: list[list[int]], sampling: SamplingParams,
                 on_tokens: Callable | None = None, cancel: Cancellation | None = None) -> Awaitable[list[Completion]]:
        """A sampler that batches continuously (vLLM's engine, a pool of them) takes each request as its own call, at
        once: it joins the running batch (and tells `on_tokens` of each step's tokens where the sampler streams them),
        and where it can, ends it once `cancel` is cancelled. Others take the calls the coalescer gathers."""
        if not api.sampler.continuous_batching:
            return self.coalescer(api, executor).generate(prompts, sampling)
        if self._callers is None:
            self._callers = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="arctic-sample")
        self._direct_calls += 1
        return asyncio.wrap_future(self._callers.submit(api.generate, prompts, sampling, None, on_tokens, cancel))

    def coalescer(self, api, executor) -> Coalescer:
        """The job's sampler takes concurrent requests as one call; a pool of replicas takes several calls."""
        if self._coalescer is None or self._coalescer[0] is not api:
            def generate(prompts, sampling):
                return asyncio.wrap_future(executor.submit(api.generate, prompts, sampling))
            self._coalescer = (api, Coalescer(generate, max_in_flight=2 * api.config.sampler.replicas
                                              if api.sampler.concurrent_generate else 1))
        return self._coalescer[1]

    def model_name(self, api) -> str:
        return self.served_model_name or api.config.model_path

    def describe(self) -> dict:
        return {"requests": dict(self.requests), "cancelled": self.cancelled, **self.gate.describe(),
                "generate_calls": self._direct_calls + (self._coalescer[1].calls if self._coalescer else 0)}


def add_serving_routes(app: FastAPI, serving: Serving, job, api_of: Callable[[], Any],
                       read_json: Callable[[Request], Awaitable[Any]], limits, run_in) -> None:
    """`api_of()` is the job's training API (or the server's error for no job); `read_json` reads a request's
    body within the server's caps; `run_in(executor, fn)` runs training-state work on the job's ordered worker."""
    path = RequestPath(serving, job, api_of, read_json, limits)
    control.add_routes(app, path, run_in)
    completions.add_routes(app, path)
    chat.add_routes(app, path)
    tokens.add_routes(app, path)
