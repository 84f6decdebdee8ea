"""Every parameter of vLLM 0.32's OpenAI request models, sent to `vllm serve` and to `arctic-rl serve` side by
side: the same model folder, the same vLLM package and engine arguments (`arctic_rl_bench.serve_vs_vllm`).

The tables hold, per route, each field of vLLM's `ChatCompletionRequest` and `CompletionRequest` with a value
other than its default, or the reason this server refuses it (docs/serving.md, "Not yet"). A field vLLM adds is
a failure here until it is placed in a table. Each accepted one must be accepted by both servers, answer with the
same non-null keys (less ours, `weight_versions`), and, sampled greedily, the same text.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytestmark = pytest.mark.scenario

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
SAMPLED = {"temperature": 1.0, "seed": 7}
"""Sent with the parameters that need sampling (greedy samples would make them moot): texts not compared."""

# Each: the fields added to the route's base request (greedy), whether its text is compared.
SHARED = {
    "frequency_penalty": ({"frequency_penalty": 0.5}, True),
    "presence_penalty": ({"presence_penalty": 0.5}, True),
    "repetition_penalty": ({"repetition_penalty": 1.3}, True),
    "ignore_eos": ({"ignore_eos": True}, True),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True, "stop": ["e"]}, True),
    "logit_bias": ({"logit_bias": {"77": 5.0}}, True),
    "allowed_token_ids": ({"allowed_token_ids": [30, 31, 32, 77]}, True),
    "bad_words": ({"bad_words": ["the"]}, True),
    "cache_salt": ({"cache_salt": "salt"}, True),
    "min_p": ({"min_p": 0.05, **SAMPLED}, False),
    "min_tokens": ({"min_tokens": 4}, True),
    "n": ({"n": 2, **SAMPLED}, False),
    "seed": ({"seed": 3, "temperature": 1.0}, False),
    "temperature": ({"temperature": 0.7}, False),
    "top_k": ({"top_k": 5, **SAMPLED}, False),
    "top_p": ({"top_p": 0.9, **SAMPLED}, False),
    "prompt_logprobs": ({"prompt_logprobs": 1}, True),
    "request_id": ({"request_id": "parity-1"}, True),
    "return_token_ids": ({"return_token_ids": True}, True),
    "skip_special_tokens": ({"skip_special_tokens": False}, True),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, True),
    "stop": ({"stop": ["a"]}, True),
    "stop_token_ids": ({"stop_token_ids": [77]}, True),
    "stream": ({"stream": True}, True),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, True),
    # a reply ended by EOS, whose text shows: neither stream sends it
    "stream, skip_special_tokens": ({"stream": True, "skip_special_tokens": False}, True),
    "structured_outputs": ({"structured_outputs": {"choice": ["yes", "no"]}}, True),
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": TOOLS[0]["function"]["parameters"]}}}, True),
    "user": ({"user": "someone"}, True),
    "session_id": ({"session_id": "parity"}, True),
    "model": ({}, True),
}
CHAT = {
    **SHARED,
    "messages": ({}, True),
    "add_generation_prompt": ({"add_generation_prompt": False}, True),
    "add_special_tokens": ({"add_special_tokens": True}, True),
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, True),
    "include_reasoning": ({"include_reasoning": False}, True),
    "logprobs": ({"logprobs": True}, True),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, True),
    "return_tokens_as_token_ids": ({"logprobs": True, "return_tokens_as_token_ids": True}, True),
    "max_completion_tokens": ({"max_completion_tokens": 5}, True),
    "max_tokens": ({"max_tokens": 5}, True),
    # Texts differ: with a tool-call parser vLLM 0.32 constrains tool calls to the parser's own format by
    # xgrammar structural tags (`<tool_call>` blocks for hermes, under auto too); ours constrains only a forced
    # choice, to vLLM's JSON-array format (docs/serving.md, "Not yet").
    "tools": ({"tools": TOOLS}, False),
    "tool_choice": ({"tools": TOOLS, "tool_choice": "required"}, False),
    "parallel_tool_calls": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, False),
}
COMPLETIONS = {
    **SHARED,
    "prompt": ({}, True),
    "add_special_tokens": ({"add_special_tokens": False}, True),
    "echo": ({"echo": True}, True),
    "logprobs": ({"logprobs": 2}, True),
    "return_tokens_as_token_ids": ({"logprobs": 1, "return_tokens_as_token_ids": True}, True),
    "max_tokens": ({"max_tokens": 5}, True),
}
# Refused here, by name (a 400 naming the field), each for its reason.
NOT_HERE = {
    "chat_template": "a request never brings its own template (it would run code of the client's on the server)",
    "continue_final_message": "not yet",
    "documents": "not yet",
    "echo": "not yet on chat (completions echo)",
    "reasoning_effort": "not yet",
    "return_prompt_text": "not yet",
    "return_token_offsets": "not yet",
    "truncate_prompt_tokens": "not yet: a prompt over the context is refused",
    "truncation_side": "not yet",
    "logprob_token_ids": "not yet",
    "thinking_token_budget": "not yet: no reasoning parser",
    "repetition_detection": "not yet",
    "watermarking": "not yet",
    "priority": "the sampler's scheduling is first come, first served",
    "stream_interval": "not yet: a piece per engine step",
    "suffix": "no fill-in-the-middle",
    "use_beam_search": "no beam search", "length_penalty": "beam search's",
    "kv_transfer_params": "no disaggregated prefill", "ec_transfer_params": "no disaggregated prefill",
    "media_io_kwargs": "text models only", "mm_payload": "text models only",
    "mm_processor_kwargs": "text models only", "return_mm_kwargs": "text models only",
    "prompt_embeds": "token and text prompts only",
    "routed_experts_prompt_start": "MoE router replay is issue 52",
    "vllm_xargs": "no custom logits processors",
}
OURS_ONLY = {"weight_versions"}
"""Keys our responses add (docs/serving.md). (`system_fingerprint` differs in value: ours names the weight
version.)"""


def _fields(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def test_the_tables_hold_every_field_of_vllms_request_models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert _fields(ChatCompletionRequest) - set(CHAT) - set(NOT_HERE) == set()
    assert _fields(CompletionRequest) - set(COMPLETIONS) - set(NOT_HERE) == set()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from arctic_rl_bench.generate import MAX_MODEL_LEN
    from arctic_rl_bench.serve_vs_vllm import _arctic_command, _ports, _server, _vllm_command

    from arctic_rl_core.engines.distributed import standalone_env
    from arctic_rl_core.models.tiny import make_tiny_model

    work = str(tmp_path_factory.mktemp("parity"))
    model = make_tiny_model("qwen3", os.path.join(work, "model"), max_positions=MAX_MODEL_LEN)
    # each server a world of its own, not this test process's rendezvous (a test before it may have set one)
    env = {**standalone_env(), "VLLM_LOGGING_LEVEL": "WARNING"}
    ours, theirs = _ports(2)
    # Tool calls read by the same parser on both (vLLM also wants auto tool choice turned on).
    arctic = _arctic_command(model, ours, work, "in_process") + ["--tool-call-parser", "hermes"]
    vllm = _vllm_command(model, theirs) + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with _server(arctic, env, f"http://127.0.0.1:{ours}", os.path.join(work, "arctic.log")) as arctic_url, \
            _server(vllm, env, f"http://127.0.0.1:{theirs}", os.path.join(work, "vllm.log")) as vllm_url:
        yield {"arctic": arctic_url, "vllm": vllm_url}


def _post(url: str, route: str, body: dict) -> tuple[int, dict]:
    """Status and body; a stream's chunks folded into one body (the text joined, the other keys unioned)."""
    if not body.get("stream"):
        response = httpx.post(f"{url}{route}", json=body, timeout=120)
        return response.status_code, response.json()
    folded: dict = {"choices": {}}
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(response.read())
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            folded.update({k: v for k, v in chunk.items() if k != "choices" and v is not None})
            for choice in chunk.get("choices") or []:
                into = folded["choices"].setdefault(choice["index"], {"text": ""})
                delta = choice.get("delta") or {}
                into["text"] += choice.get("text") or delta.get("content") or ""
                into.update({k: v for k, v in choice.items() if k not in ("text", "delta") and v is not None})
    folded["choices"] = [folded["choices"][i] for i in sorted(folded["choices"])]
    return 200, folded


def _keys(body: dict) -> dict:
    """The non-null keys of the body, of its choices and of their messages (less ours)."""
    def present(d):
        return sorted(k for k, v in d.items() if v is not None and k not in OURS_ONLY)
    choices = body.get("choices") or [{}]
    return {"body": present(body), "choice": present(choices[0]),
            "message": present(choices[0].get("message") or {})}


def _texts(body: dict) -> list:
    out = []
    for choice in body.get("choices", []):
        message = choice.get("message") or {}
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []]
        out.append([choice.get("text", message.get("content")), calls, choice.get("finish_reason")])
    return out


@pytest.mark.parametrize("route, table", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS)],
                         ids=["chat", "completions"])
def test_every_parameter_vllm_serve_takes_is_taken_alike(servers, route, table):
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    base.update({"messages": [{"role": "user", "content": "Name the weather in Paris."}]} if "chat" in route
                else {"prompt": "The weather in Paris is"})
    differences = {}
    for name, (extra, same_text) in table.items():
        body = {**base, **extra}
        answers = {side: _post(url, route, body) for side, url in servers.items()}
        (ours, our_body), (theirs, their_body) = answers["arctic"], answers["vllm"]
        if [ours, theirs] != [200, 200]:
            differences[name] = {"status": [ours, theirs], "ours": our_body.get("error"),
                                 "theirs": their_body.get("error", their_body.get("message"))}
            continue
        keys = {part: [sorted(set(a) - set(b)), sorted(set(b) - set(a))]
                for (part, a), b in zip(_keys(our_body).items(), _keys(their_body).values()) if a != b}
        texts = [_texts(our_body), _texts(their_body)] if same_text else None
        if keys or texts and texts[0] != texts[1]:
            differences[name] = {"keys (ours only, theirs only)": keys, **({"texts": texts} if texts else {})}
    assert differences == {}, json.dumps(differences)[:12000]


@pytest.mark.parametrize("route, name", [("/v1/chat/completions", n) for n in sorted(NOT_HERE)])
def test_what_is_not_here_is_refused_by_name(servers, route, name):
    value = {"stream_interval": 2, "priority": 1, "echo": True, "use_beam_search": True, "watermarking": {"key": 1},
             "length_penalty": 0.5}.get(name, "x")
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], name: value}
    status, answer = _post(servers["arctic"], route, body)
    assert status == 400 and answer["error"]["param"] == name, answer
