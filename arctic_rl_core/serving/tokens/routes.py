"""vLLM's token-in, token-out route (`/inference/v1/generate`, and `/skyrl/v1/generate` where SkyRL's client wants
routed experts), SkyRL's and prime-rl's rollouts; and `/tokenize`, `/detokenize`."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.serving.logprobs import chat_logprobs, token_logprobs, vllm_prompt_logprobs
from arctic_rl_core.serving.request_path import RequestPath, Sampled, renamed, weight_spans
from arctic_rl_core.serving.routed_experts import check_routes_start, routes_packed
from arctic_rl_core.serving.text import StreamedText
from arctic_rl_core.serving.tokens.protocol import DetokenizeRequest, TokenGenerateRequest, TokenizeRequest
from arctic_rl_core.serving.tool_calls import as_rendered


def add_routes(app: FastAPI, path: RequestPath) -> None:
    serving = path.serving

    @app.post("/inference/v1/generate")
    @app.post("/skyrl/v1/generate")  # SkyRL's client's route where it wants routed experts: the same, routes packed
    async def generate_tokens(request: Request):
        req, api, model = await path.begin(request, TokenGenerateRequest)
        if req.return_sample_support:
            raise InvalidRequest("return_sample_support", "this server samples from the model's full distribution: no "
                                 "sample support to return (SkyRL's enable_sample_support_replay stays off)")
        if req.output_mode == "text" and not req.sampling_params.detokenize:
            raise InvalidRequest("output_mode", "'text' needs sampling_params.detokenize true")
        sampling = req.sampling(path.max_tokens(api, req.sampling_params.max_tokens, [req.token_ids]))
        check_routes_start(req.sampling_params.routed_experts_prompt_start, req.token_ids,
                            "sampling_params.routed_experts_prompt_start")
        session = path.session_of(request, req.session_id)
        fields = lambda f: renamed(f, "token_ids", False, sampling_prefix="sampling_params.")  # noqa: E731
        codec = serving.codec(api) if req.output_mode == "text" else None
        params = req.sampling_params
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        request_id = req.request_id or uuid.uuid4().hex
        head = {"request_id": request_id, "output_mode": req.output_mode}

        def entries(token_ids, logprobs, tops, ranks) -> dict | None:
            """vLLM's: `GenerateLogProbs` by token id, or with text the chat shape."""
            if params.logprobs is None:
                return None
            if codec is not None:
                return {"content": chat_logprobs(codec, token_ids, logprobs, tops, False)}
            return {"content": token_logprobs(token_ids, logprobs, tops, ranks)}

        def choices_of(sampled: Sampled) -> list[dict]:
            choices = []
            for index, c in sampled.choices():
                if c is None:
                    choices.append({"index": index, "finish_reason": "abort", "stop_reason": None, "token_ids": [],
                                    "logprobs": None, **({"text": ""} if codec else {})})
                    continue
                choice = {"index": index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
                          "weight_versions": weight_spans(c), "stop_reason": None,
                          "logprobs": entries(c.token_ids, c.logprobs, c.top_logprobs, c.ranks)}
                choice.update(routes_packed(c, params.routed_experts_prompt_start))
                if codec is not None:
                    choice["text"], choice["stop_reason"] = codec.finished_text(
                        c, stops, params.stop_token_ids or [], params.include_stop_str_in_output,
                        params.skip_special_tokens)
                elif c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in (params.stop_token_ids or []):
                    choice["stop_reason"] = c.token_ids[-1]
                elif c.finish_reason == "repetition":
                    choice["stop_reason"] = "repetition_detected"
                choices.append(choice)
            return choices

        if path.streams(req, api, sampling, params.logprobs):
            # vLLM's stream: each step's token ids (and text) with their log-probs, then per choice a last chunk
            # with its finish and stop reasons and weight versions; the prompt's ids on the first, if asked.
            unsent_prompt = [req.token_ids] if req.return_token_ids else []

            def piece(index: int, text: str, token_ids: list[int], logprobs: list[float], tops, ranks) -> dict:
                chunk = {**head, "choices": [{"index": index, "finish_reason": None, "stop_reason": None,
                                              "token_ids": token_ids, "logprobs": entries(token_ids, logprobs, tops, ranks),
                                              **({"text": text} if codec else {})}]}
                if unsent_prompt:
                    chunk["prompt_token_ids"] = unsent_prompt.pop()
                return chunk

            def last(sampled: Sampled, sent: dict[int, StreamedText]) -> list[dict]:
                return [{**head, "choices": [{**choice, "token_ids": [], "logprobs": None, **({"text": (
                    sent[choice["index"]].rest(choice["text"]) if choice["index"] in sent else choice["text"])}
                    if codec else {})}]} for choice in choices_of(sampled)]
            usage_head = head if req.stream_options and req.stream_options.include_usage else None
            return path.stream_as_sampled(api, "generate", request, [req.token_ids], sampling, session, fields,
                                     lambda _: StreamedText(codec, stops, params.skip_special_tokens,
                                                            params.stop_token_ids or [], params.ignore_eos,
                                                            params.include_stop_str_in_output) if codec else _NO_TEXT,
                                     [], piece, last, usage_head, params.stream_interval)
        sampled = await path.sample(api, "generate", [req.token_ids], sampling, session, fields, request)
        if sampled is None:
            return Response(status_code=499)
        first = sampled.completions[0] if sampled.completions else None
        payload = {"request_id": request_id, "model": model, "created": int(time.time()),
                   "output_mode": req.output_mode, "usage": sampled.usage, "prompt_token_ids": req.token_ids,
                   "prompt_logprobs": vllm_prompt_logprobs(first) if first else None, "choices": choices_of(sampled)}
        return path.respond(req, payload, lambda p: [
            {**head, "choices": [choice], **({"prompt_token_ids": p["prompt_token_ids"]} if i == 0 and req.return_token_ids else {})}
            for i, choice in enumerate(p["choices"])], head)

    # -- tokenizer ------------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req, api, _ = await path.begin(request, TokenizeRequest)
        codec = serving.codec(api)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("prompt", "give a prompt or messages, not both")
        if req.messages is not None:
            tokens = codec.render_chat(req.messages, as_rendered(req.tools), req.add_generation_prompt, req.chat_template_kwargs)
            if req.add_special_tokens:
                tokens = codec.encode(codec.decode(tokens, skip_special_tokens=False), True, "messages")
        else:
            tokens = codec.encode(req.prompt, req.add_special_tokens is not False, "prompt")
        return {"count": len(tokens), "max_model_len": api.sampler.max_context, "tokens": tokens,
                "token_strs": [codec.token_text(t, False) for t in tokens] if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req, api, _ = await path.begin(request, DetokenizeRequest)
        vocab = api.engine.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"tokens[{bad}]", f"token id {req.tokens[bad]} is outside the vocabulary ({vocab})")
        return {"prompt": serving.codec(api).decode(req.tokens, skip_special_tokens=False)}


class _NoText:
    """The text a token-mode stream sends: none."""

    @staticmethod
    def add(token_ids: list[int]) -> str:
        return ""

    @staticmethod
    def rest(finished: str) -> str:
        return ""


_NO_TEXT = _NoText()
