"""`/v1/completions`: OpenAI's schema with vLLM's extensions (`echo`, `return_token_ids`,
`return_tokens_as_token_ids`, `prompt_logprobs`), whole or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.serving.completions.protocol import CompletionRequest
from arctic_rl_core.serving.logprobs import completion_logprobs, echoed_logprobs, openai_prompt_logprobs
from arctic_rl_core.serving.request_path import RequestPath, Sampled, constraint_field, fingerprint, renamed, weight_spans
from arctic_rl_core.serving.routed_experts import check_routes_start, routes_as_vllm
from arctic_rl_core.serving.text import StreamedText


def add_routes(app: FastAPI, path: RequestPath) -> None:
    serving = path.serving

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, api, model = await path.begin(request, CompletionRequest)
        codec = serving.codec(api)
        prompt = req.prompt
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequest("prompt", "must hold at least one prompt")
        prompts = [req.truncated(p if isinstance(p, list) else codec.encode(p, req.add_special_tokens, "prompt"),
                                 api.sampler.max_context, True) for p in prompt]
        for p in prompts:
            check_routes_start(req.routed_experts_prompt_start, p, "routed_experts_prompt_start")
        many = len(prompts) > 1
        session = path.session_of(request, req.session_id)
        fields = lambda f: renamed(f, "prompt", many, constraint=constraint_field(req, False))  # noqa: E731
        # vLLM's echo: each choice's text after its prompt's; with logprobs, the prompt's log-probs before the
        # reply's. With max_tokens 0 the prompt alone comes back (one token is sampled and not shown).
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens", "must be at least 1 (0 only with echo)")
        if req.max_tokens == 0 and session is not None:
            raise InvalidRequest("max_tokens", "0 samples nothing to record in a session")
        prompt_only = req.max_tokens == 0
        sampling = req.sampling(1 if prompt_only else req.max_tokens or 16, req.logprobs or 0)
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            sampling = sampling.model_copy(update={"prompt_logprobs": req.logprobs})
        echoes = ["" if req.return_token_ids else p if isinstance(p, str) and req.truncate_prompt_tokens is None
                  else codec.decode(ids, req.skip_special_tokens)
                  for p, ids in zip(prompt, prompts)] if req.echo else None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": fingerprint(api)}

        def choices_of(sampled: Sampled, echoed: bool = True) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                prompt_ids = prompts[index // req.n]
                if c is None:
                    choices.append({"index": index, "text": "", "logprobs": None, "finish_reason": "abort",
                                    "stop_reason": None, "token_ids": [] if req.return_token_ids else None})
                    continue
                text, stop_reason = codec.finished_text(c, req.stops(), req.stop_token_ids or [],
                                                        req.include_stop_str_in_output, req.skip_special_tokens)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(codec, c.token_ids, c.logprobs, c.top_logprobs,
                                                    req.return_tokens_as_token_ids)
                if echoes is not None and echoed:
                    echo = echoes[index // req.n]
                    text = echo if prompt_only else echo + text
                    if logprobs is not None:
                        logprobs = echoed_logprobs(codec, prompt_ids, c, req.return_tokens_as_token_ids,
                                                    None if prompt_only else logprobs)
                choices.append({
                    "index": index, "text": text, "finish_reason": c.finish_reason, "stop_reason": stop_reason,
                    "logprobs": logprobs,
                    "token_ids": c.token_ids if req.return_token_ids else None,
                    "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                    "prompt_logprobs": openai_prompt_logprobs(codec, c, prompt_ids),
                    "weight_versions": weight_spans(c), **routes_as_vllm(c, req.routed_experts_prompt_start)})
            return choices

        usage_head = head if req.stream_options and req.stream_options.include_usage else None
        if path.streams(req, api, sampling, req.logprobs):
            text_at: dict[int, int] = {}  # per choice, where the next piece's text starts (its log-probs' offsets)

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, _ranks) -> dict:
                entries = None
                if req.logprobs is not None:
                    entries = completion_logprobs(codec, token_ids, logprobs, tops, req.return_tokens_as_token_ids,
                                                   text_at.get(index, 0))
                    text_at[index] = text_at.get(index, 0) + sum(len(codec.token_text(t, False)) for t in token_ids)
                return {**head, "choices": [{"index": index, "text": text, "logprobs": entries, "finish_reason": None,
                                             "stop_reason": None, **({"token_ids": token_ids} if req.return_token_ids else {})}]}

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                return [{**head, "choices": [{**choice, "token_ids": None, "logprobs": None,
                                              "text": sent[choice["index"]].rest(choice["text"])
                                              if choice["index"] in sent else choice["text"]}]}
                        for choice in choices_of(sampled, echoed=False)]  # the echo went first
            first = [{**head, "choices": [{"index": i, "text": echoes[i // req.n], "logprobs": None,
                                           "finish_reason": None, "stop_reason": None}]}
                     for i in range(len(prompts) * req.n)] if echoes is not None else []
            return path.stream_as_sampled(api, "completions", request, prompts, sampling, session, fields,
                                     lambda _: StreamedText(codec, req.stops(), req.skip_special_tokens,
                                                            req.stop_token_ids or [], req.ignore_eos,
                                                            req.include_stop_str_in_output),
                                     first, piece, last, usage_head, req.stream_interval)
        sampled = await path.sample(api, "completions", prompts, sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        payload = {**head, "choices": choices_of(sampled), "usage": sampled.usage}
        return path.respond(req, payload, lambda p: [{**head, "choices": [choice]} for choice in p["choices"]], head)
