"""Every parameter of vLLM 0.32's OpenAI request models, sent to `vllm serve` and to `arctic-rl serve` side by
side: the same model folder, the same vLLM package and engine arguments (`arctic_rl_bench.serve_vs_vllm`).

The tables hold, per route, each field of vLLM's `ChatCompletionRequest` and `CompletionRequest` with a value
other than its default, or the reason this server refuses it (docs/serving.md, "Not yet"). A field vLLM adds is
a failure here until it is placed in a table. Each accepted one must be accepted by both servers, answer with the
same non-null keys (less ours, `weight_versions`), and, sampled greedily, the same text.
"""

from __future__ import annotations

import itertools
import json
import os

import httpx
import pytest

# One worker runs the whole file: `make scenarios` deals ungrouped tests one by one, and each worker that got one
# would start both servers of the module's fixture (about 100 s each on a 2-core CI machine).
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("vllm_serve_parity")]

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
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 5}, True),
    # a greedy random model falls into a loop: both end it at the same token, finish reason "repetition"
    "repetition_detection": ({"repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "max_tokens": 64,
                              "ignore_eos": True}, True),
    "truncation_side": ({"truncate_prompt_tokens": 5, "truncation_side": "right"}, True),
    "stream_interval": ({"stream": True, "stream_interval": 3}, True),
    "routed_experts_prompt_start": ({"routed_experts_prompt_start": 0}, True),
    # taken by both and changing nothing under these servers' flags (docs/serving.md)
    "priority": ({"priority": 1}, True),
    "watermarking": ({"watermarking": True}, True),
    "kv_transfer_params": ({"kv_transfer_params": {"do_remote_prefill": False}}, True),
    "ec_transfer_params": ({"ec_transfer_params": {"cache": 1}}, True),
    "vllm_xargs": ({"vllm_xargs": {"note": 1}}, True),
    "return_token_offsets": ({"return_token_offsets": True}, True),
    "mm_payload": ({"mm_payload": "none"}, True),
    "return_mm_kwargs": ({"return_mm_kwargs": False}, True),
    "media_io_kwargs": ({"media_io_kwargs": {}}, True),
    "mm_processor_kwargs": ({"mm_processor_kwargs": {}}, True),
}
CONTINUED = [{"role": "user", "content": "Name the weather in Paris."}, {"role": "assistant", "content": "It is"}]
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
    "continue_final_message": ({"continue_final_message": True, "add_generation_prompt": False,
                                "messages": CONTINUED}, True),
    "echo": ({"echo": True, "add_generation_prompt": False, "messages": CONTINUED}, True),
    "documents": ({"documents": [{"title": "Paris", "text": "Sunny all week."}]}, True),
    "reasoning_effort": ({"reasoning_effort": "low"}, True),
    "return_prompt_text": ({"return_prompt_text": True}, True),
    "return_prompt_text, streamed": ({"return_prompt_text": True, "stream": True}, True),
    # Both read tool calls with vLLM's hermes parser, which constrains forced calls to its `<tool_call>` blocks
    "tools": ({"tools": TOOLS}, True),
    "tool_choice": ({"tools": TOOLS, "tool_choice": "required"}, True),
    "tool_choice, named": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                           True),
    "tool_choice, strict tool": ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}],
                                  "tool_choice": "auto", "max_tokens": 24}, True),
    "parallel_tool_calls": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, True),
    "tool_choice, streamed": ({"tools": TOOLS, "tool_choice": "required", "stream": True, "max_tokens": 24}, True),
    "tools, streamed": ({"tools": TOOLS, "stream": True, "max_tokens": 24}, True),
    "tool_choice none": ({"tools": TOOLS, "tool_choice": "none"}, True),
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
# Refused here, by name (a 400 naming the field), each for its reason, though `vllm serve` takes them.
NOT_HERE = {
    "use_beam_search": "no beam search: a beam is not a sample of the policy", "length_penalty": "beam search's",
    # vLLM 0.32 gathers them for the whole engine batch in place of the top-k log-probs (v1/sample/sampler.py):
    # a request with them would change what concurrent requests (rollouts asking for top_logprobs) get back
    "logprob_token_ids": "would replace the top-k log-probs of every request in its engine batch",
}
# Refused by both, under these servers' flags: (route, value).
REFUSED_BY_BOTH = {
    "chat_template": ("/v1/chat/completions", "{{ 'hi' }}"),  # a client's template runs on the server
    "thinking_token_budget": ("/v1/chat/completions", 4),  # no reasoning parser
    "suffix": ("/v1/completions", "x"),  # no fill-in-the-middle template
    "prompt_embeds": ("/v1/completions", "eA=="),  # no --enable-prompt-embeds
}
OURS_ONLY = {"weight_versions"}
"""Keys our responses add (docs/serving.md). (`system_fingerprint` differs in value: ours names the weight
version.)"""


def _fields(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def test_the_tables_hold_every_field_of_vllms_request_models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    assert _fields(ChatCompletionRequest) - set(CHAT) - set(NOT_HERE) - set(REFUSED_BY_BOTH) == set()
    assert _fields(CompletionRequest) - set(COMPLETIONS) - set(NOT_HERE) - set(REFUSED_BY_BOTH) == set()


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Both servers' URLs, and our server's process id."""
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
    arctic = _arctic_command(model, ours, work) + ["--tool-call-parser", "hermes"]
    # (and the token-in, token-out route, which vLLM serves only when asked)
    vllm = _vllm_command(model, theirs) + ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                           "--enable-scale-out"]
    with _server(arctic, env, f"http://127.0.0.1:{ours}", os.path.join(work, "arctic.log")) as (arctic_url, pid), \
            _server(vllm, env, f"http://127.0.0.1:{theirs}", os.path.join(work, "vllm.log")) as (vllm_url, _):
        yield {"arctic": arctic_url, "vllm": vllm_url}, pid


@pytest.fixture(scope="module")
def servers(started):
    return started[0]


def test_our_server_runs_vllms_engine_core_in_a_process_of_its_own_by_default(started):
    """`arctic-rl serve` on a job that sets no placement: vLLM's engine core is a process of its own under the
    server, as under `vllm serve`, with its one worker inside it (as vLLM runs one GPU) computing on all cores but
    the one vLLM leaves its server, and the status route says which placement runs, on how many threads."""
    import psutil

    urls, pid = started
    status = httpx.get(f"{urls['arctic']}/v1/status", timeout=60).json()
    assert status["config"]["sampler"]["placement"] == "auto"
    assert [(row["placement"], row["compute_threads"]) for row in status["backend"]["sampler"]] == \
        [("subprocess", max(1, len(os.sched_getaffinity(0)) - 1))]
    names = [p.name() for p in psutil.Process(pid).children(recursive=True)]
    # (a name as the kernel keeps it: its first 15 characters)
    assert any(n.startswith("VLLM::EngineCor") for n in names) and not any("Worker" in n for n in names), names


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
                for call in delta.get("tool_calls") or []:  # a call's name, then its arguments piece by piece
                    calls = into.setdefault("message", {}).setdefault("tool_calls", {})
                    folded_call = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                    for key in ("name", "arguments"):
                        folded_call["function"][key] += (call.get("function") or {}).get(key) or ""
                into.update({k: v for k, v in choice.items() if k not in ("text", "delta") and v is not None})
    folded["choices"] = [folded["choices"][i] for i in sorted(folded["choices"])]
    for choice in folded["choices"]:
        if "message" in choice:
            choice["message"]["tool_calls"] = [calls for _, calls in sorted(choice["message"]["tool_calls"].items())]
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
        out.append([choice.get("text", message.get("content")), calls, choice.get("finish_reason"),
                    choice.get("stop_reason")])
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


@pytest.mark.parametrize("name", sorted(NOT_HERE))
def test_what_is_not_here_is_refused_by_name(servers, name):
    value = {"use_beam_search": True, "length_penalty": 0.5, "logprob_token_ids": [5, 6]}[name]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            name: value}
    status, answer = _post(servers["arctic"], "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == name, answer


@pytest.mark.parametrize("name", sorted(REFUSED_BY_BOTH))
def test_what_vllm_serve_refuses_is_refused_here_by_name(servers, name):
    route, value = REFUSED_BY_BOTH[name]
    body = {"model": "tiny", "max_tokens": 2, name: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    (ours, answer), (theirs, _) = (_post(servers[side], route, body) for side in ("arctic", "vllm"))
    assert [ours, theirs] == [400, 400] and answer["error"]["param"] == name, answer


def _pieces(url: str, body: dict) -> list[int]:
    """The tokens each streamed chunk carries."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return [len(choice.get("token_ids") or []) for chunk in chunks for choice in chunk["choices"]]


def test_stream_interval_cuts_a_stream_into_the_same_pieces(servers):
    body = {"model": "tiny", "prompt": "The weather in Paris is", "max_tokens": 11, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_interval": 4, "return_token_ids": True}
    ours, theirs = (_pieces(servers[side], body) for side in ("arctic", "vllm"))
    assert sum(ours) == 11 and [n for n in ours if n] == [1, 4, 4, 2], ours  # the first token at once
    # vllm serve cuts at the same tokens, but a piece its client has not yet read is merged with the next one
    # (vLLM's RequestOutputCollector), so under load it may send fewer pieces: its cuts are some of ours
    assert sum(theirs) == 11 and set(_cuts(theirs)) <= set(_cuts(ours)), (ours, theirs)


def _cuts(pieces: list[int]) -> list[int]:
    """Where a stream of pieces of these sizes was cut: the tokens sent by the end of each piece."""
    return list(itertools.accumulate(n for n in pieces if n))


@pytest.mark.parametrize("route", ["/v1/completions", "/inference/v1/generate"])
def test_repetition_detection_ends_a_loop_where_vllm_serve_ends_it(servers, route):
    detect = {"max_pattern_size": 4, "min_count": 3}
    if route == "/v1/completions":
        body = {"model": "tiny", "prompt": "The weather in Paris is", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "repetition_detection": detect}
    else:
        body = {"model": "tiny", "token_ids": [5, 9, 33, 70, 12], "sampling_params": {
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "repetition_detection": detect}}
    ours, theirs = (httpx.post(servers[side] + route, json=body, timeout=120).json()["choices"][0]
                    for side in ("arctic", "vllm"))
    # a greedy random model falls into a loop: both end it at the same token, the repeats kept
    assert ours["finish_reason"] == "repetition" and ours["stop_reason"] == "repetition_detected", ours
    assert len(ours["token_ids"]) < 200 and ours["token_ids"] == theirs["token_ids"]
    assert [ours["finish_reason"], ours["stop_reason"]] == [theirs["finish_reason"], theirs["stop_reason"]]
