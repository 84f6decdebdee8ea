"""`/v1/chat/completions`: OpenAI's schema with vLLM's extensions, the prompt rendered by the model's chat template,
tool calls read by the server's parser or forced by the request, whole or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.serving.chat.protocol import ChatCompletionRequest, NamedToolChoice
from arctic_rl_core.serving.constraints import check_tools, forced_calls, tool_schema
from arctic_rl_core.serving.logprobs import chat_logprobs, openai_prompt_logprobs
from arctic_rl_core.serving.request_path import RequestPath, Sampled, constraint_field, fingerprint, renamed, weight_spans
from arctic_rl_core.serving.routed_experts import check_routes_start, routes_as_vllm
from arctic_rl_core.serving.text import StreamedText
from arctic_rl_core.serving.tool_calls import ToolCallStream, as_rendered
from arctic_rl_core.types import Completion


def add_routes(app: FastAPI, path: RequestPath) -> None:
    serving = path.serving

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, api, model = await path.begin(request, ChatCompletionRequest)
        codec = serving.codec(api)
        if "prompt_token_ids" in (req.kv_transfer_params or {}):
            raise InvalidRequest("kv_transfer_params.prompt_token_ids", "this server has no disaggregated prefill: "
                                                                        "the prompt is the messages' rendering")
        # As vLLM, the tools stay in the prompt under tool_choice "none": the model only must not call them.
        prompt_text = codec.chat_text(req.messages, as_rendered(req.tools), req.add_generation_prompt,
                                      req.template_kwargs(), req.continue_final_message, req.documents)
        budget = req.max_completion_tokens or req.max_tokens
        prompt_ids = req.truncated(codec.encode(prompt_text, False, "messages"), api.sampler.max_context,
                                   budget is not None)
        check_routes_start(req.routed_experts_prompt_start, prompt_ids, "routed_experts_prompt_start")
        # vLLM's: the reply's role is the last message's where no generation prompt opens an assistant's turn
        reply_role = "assistant" if req.add_generation_prompt else req.messages[-1]["role"]
        echoed = _content_text(req.messages[-1]) if req.echo and req.messages[-1]["role"] == reply_role else ""
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        check_tools(req.tools, req.tool_choice, req.constraint() is not None)
        tools = serving.tool_calls(api, req)  # vLLM's parser, where the server has one
        # Without a parser a forced choice constrains the reply to vLLM's JSON form of calls (`serving.constraints`).
        forced = req.tool_choice if tools is None and (req.tool_choice == "required" or
                                                       isinstance(req.tool_choice, NamedToolChoice)) else None
        calls_schema = tool_schema(req.tools or [], forced, req.parallel_tool_calls)
        constraint = tools.constraint() if tools is not None else \
            None if calls_schema is None else {"json_schema": calls_schema}
        sampling = req.sampling(path.max_tokens(api, budget, [prompt_ids]), req.top_logprobs or 0, constraint)
        if req.echo and req.prompt_logprobs is None:  # vLLM's echo returns the prompt's log-probs
            sampling = sampling.model_copy(update={"prompt_logprobs": req.top_logprobs or 0})
        session = path.session_of(request, req.session_id)
        by_tools = forced is not None or tools is not None and (constraint or {}).get("structural_tag") is not None
        fields = lambda f: renamed(f, "messages", False, constraint=constraint_field(req, by_tools))  # noqa: E731
        skip_special_tokens = req.skip_special_tokens if tools is None else tools.skip_special_tokens
        created = int(time.time())
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": fingerprint(api)}

        def text_of(c: Completion) -> tuple[str, Any]:
            """The reply's text and stop reason (with a parser: what the parser reads)."""
            return codec.finished_text(c, req.stops(), req.stop_token_ids or [], req.include_stop_str_in_output,
                                       skip_special_tokens)

        def choices_of(sampled: Sampled) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                if c is None:
                    choices.append({"index": index, "message": {"role": reply_role, "content": ""}, "logprobs": None,
                                    "finish_reason": "abort", "stop_reason": None,
                                    "token_ids": [] if req.return_token_ids else None})
                    continue
                text, stop_reason = text_of(c)
                calls, finish_reason = [], c.finish_reason
                if forced is not None:  # the reply is the calls (vLLM: empty content, a named call ends as "stop")
                    calls, text = forced_calls(text, forced), ""
                    finish_reason = "tool_calls" if forced == "required" and c.finish_reason == "stop" else finish_reason
                elif tools is not None:
                    text, calls, finish_reason = tools.parse(text, c.token_ids, c.finish_reason)
                content = echoed + text if echoed and text is not None else text
                message = {"role": reply_role, "content": content, **({"tool_calls": calls} if calls else {})}
                choices.append({
                    "index": index, "message": message,
                    "logprobs": {"content": chat_logprobs(codec, c.token_ids, c.logprobs, c.top_logprobs,
                                                           req.return_tokens_as_token_ids)} if req.logprobs else None,
                    "finish_reason": finish_reason, "stop_reason": stop_reason,
                    "token_ids": c.token_ids if req.return_token_ids else None, "weight_versions": weight_spans(c),
                    **routes_as_vllm(c, req.routed_experts_prompt_start)})
            return choices

        def role(index: int) -> dict:
            return {**head, "choices": [{"index": index, "delta": {"role": reply_role, "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                    **({"prompt_text": prompt_text} if req.return_prompt_text else {})}

        def ending(choice: dict, content: str | None, token_ids, logprobs) -> list[dict]:
            i = choice["index"]
            delta = {"content": content}
            if "tool_calls" in choice["message"]:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(choice["message"]["tool_calls"])]
            return [{**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": None, "token_ids": token_ids}]},
                    {**head, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                                          "stop_reason": choice["stop_reason"],
                                          "weight_versions": choice.get("weight_versions")}]}]

        usage_head = head if req.stream_options and req.stream_options.include_usage else None
        if path.streams(req, api, sampling, req.logprobs) and forced is None:
            first = [role(i) for i in range(sampling.n)]
            if req.return_token_ids:
                first[0]["prompt_token_ids"] = prompt_ids
            calls_of: dict[int, ToolCallStream] = {}
            """Per choice, its reply read by the parser as it streams."""

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, _ranks) -> dict | None:
                entries = {"content": chat_logprobs(codec, token_ids, logprobs, tops, req.return_tokens_as_token_ids)
                           } if req.logprobs else None
                delta: dict | None = {"content": text}
                if tools is not None:
                    delta = calls_of.setdefault(index, tools.stream(prompt_ids)).delta(text, token_ids, finished=False)
                    if delta is None:  # text the parser holds back: a chunk only for the tokens' ids or log-probs
                        if entries is None and not req.return_token_ids:
                            return None
                        delta = {}
                return {**head, "choices": [{"index": index, "delta": delta, "logprobs": entries,
                                             "finish_reason": None,
                                             **({"token_ids": token_ids} if req.return_token_ids else {})}]}

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                if tools is None:
                    return [event for choice in choices_of(sampled) for event in ending(
                        choice, sent[choice["index"]].rest(choice["message"]["content"] or "") if choice["index"] in sent
                        else choice["message"]["content"], None, None)]
                events = []
                for index, c in sampled.choices():  # the text not yet sent goes through the parser, which ends
                    if c is None:
                        events.append({**head, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                            "finish_reason": "abort", "stop_reason": None}]})
                        continue
                    text, stop_reason = text_of(c)
                    calls = calls_of.setdefault(index, tools.stream(prompt_ids))
                    delta = calls.delta(sent[index].rest(text) if index in sent else text, [], finished=True)
                    events.append({**head, "choices": [{
                        "index": index, "delta": delta or {}, "logprobs": None,
                        "finish_reason": calls.finish_reason(c.finish_reason), "stop_reason": stop_reason,
                        "weight_versions": weight_spans(c)}]})
                return events
            return path.stream_as_sampled(api, "chat", request, [prompt_ids], sampling, session, fields,
                                     lambda _: StreamedText(codec, req.stops(), skip_special_tokens,
                                                            req.stop_token_ids or [], req.ignore_eos,
                                                            req.include_stop_str_in_output),
                                     first, piece, last, usage_head, req.stream_interval)
        sampled = await path.sample(api, "chat", [prompt_ids], sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)
        first = sampled.completions[0] if sampled.completions else None
        payload = {"id": ident, "object": "chat.completion", "created": created, "model": model,
                   "system_fingerprint": head["system_fingerprint"], "choices": choices_of(sampled), "usage": sampled.usage,
                   "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                   "prompt_logprobs": openai_prompt_logprobs(codec, first, prompt_ids) if first else None,
                   "prompt_text": prompt_text if req.return_prompt_text else None}

        def chunks(p):
            out = [event for choice in p["choices"]
                   for event in [role(choice["index"])] + ending(choice, choice["message"]["content"], choice["token_ids"],
                                                                 choice["logprobs"])]
            if p["prompt_token_ids"] is not None:
                out[0]["prompt_token_ids"] = p["prompt_token_ids"]
            return out
        return path.respond(req, payload, chunks, head)


def _content_text(message: dict) -> str:
    """A message's text: its content, or its text parts joined by newlines (vLLM's echo)."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content or ""
