"""The OpenAI- and vLLM-compatible routes, driven by the real clients: the `openai` SDK and vLLM's own
request and response models for `/inference/v1/generate`."""

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.run import ServerThread
from tests.conftest import LIGHT_SAMPLER

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def server_thread(tiny_model):
    config = BackendConfig.model_validate({"model_path": tiny_model, "sampler": LIGHT_SAMPLER,
                                           "engine": {"learning_rate": 1e-2}})
    thread = ServerThread(ServerSettings(port=free_loopback_port(), served_model_name=MODEL), config)
    thread.__enter__()
    yield thread
    thread.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server(server_thread):
    return f"http://{server_thread.settings.host}:{server_thread.settings.port}", server_thread.app.state.job.api


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_completions_return_the_sampled_token_ids_and_their_log_probs(server, sdk, tiny_model):
    from transformers import AutoTokenizer

    url, backend = server
    out = sdk.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, n=2, seed=3, logprobs=2,
                                 extra_body={"return_token_ids": True, "prompt_logprobs": 1})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer("The quick brown fox")["input_ids"]
    assert len(out.choices) == 2 and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    for choice in out.choices:
        assert choice.prompt_token_ids == prompt
        # as vLLM's detokenizer writes it: less a last character whose bytes never all came
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
        assert choice.weight_versions == [{"version": "0", "start": 0, "end": len(choice.token_ids)}]
        # The reported log-probs are the sampler's own: scoring the same tokens gives them back.
        scored = backend.log_probs([{"prompt_ids": prompt, "response_ids": choice.token_ids}], source="sampler").logprobs[0]
        assert choice.logprobs.token_logprobs == pytest.approx(scored, abs=1e-4)
        # vLLM's prompt_logprobs: None for the first prompt token, then each token's own log-prob.
        assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) == len(prompt)
        own = [entry[str(t)]["logprob"] for entry, t in zip(choice.prompt_logprobs[1:], prompt[1:])]
        whole = backend.log_probs([{"prompt_ids": prompt[:1], "response_ids": prompt[1:]}], source="sampler").logprobs[0]
        assert own == pytest.approx(whole, abs=1e-4)
    # Token-id prompts are taken as they are, and tokens can be named by id.
    ids = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=0,
                                 extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    assert ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids.choices[0].token_ids]


def test_echo_puts_the_prompt_and_its_log_probs_before_the_completion(server, sdk, tiny_model):
    from transformers import AutoTokenizer

    url, backend = server
    prompt_text = "The quick brown fox"
    prompt = AutoTokenizer.from_pretrained(tiny_model)(prompt_text)["input_ids"]
    plain = sdk.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4, temperature=0, logprobs=1)
    # best_of is taken and not applied, as by vLLM 0.32 (its engine has no best-of sampling)
    echoed = sdk.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4, temperature=0, logprobs=1, echo=True,
                                    best_of=3)
    [choice], [reply] = echoed.choices, plain.choices
    assert choice.text == prompt_text + reply.text
    logprobs = choice.logprobs
    assert logprobs.tokens[len(prompt):] == reply.logprobs.tokens
    assert logprobs.token_logprobs[len(prompt):] == reply.logprobs.token_logprobs
    # The prompt's own log-probs first (the first token's null: it has no context), as the sampler scores them.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    whole = backend.log_probs([{"prompt_ids": prompt[:1], "response_ids": prompt[1:]}], source="sampler").logprobs[0]
    assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(whole, abs=1e-4)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[len(prompt)] >= len(prompt_text) - 1
    # max_tokens 0 with echo: the prompt alone, with its log-probs; without echo it is refused
    only = sdk.completions.create(model=MODEL, prompt=prompt_text, max_tokens=0, logprobs=0, echo=True).choices[0]
    assert only.text == prompt_text and len(only.logprobs.tokens) == len(prompt)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt=prompt_text, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    # Streamed, the prompt's text comes first (a sampler that streams tokens sends it alone, then the pieces).
    pieces = [c.choices[0].text for c in sdk.completions.create(model=MODEL, prompt=prompt_text, max_tokens=4,
                                                                 temperature=0, echo=True, stream=True) if c.choices]
    assert pieces[0].startswith(prompt_text) and "".join(pieces) == prompt_text + reply.text


def test_chat_renders_with_the_model_template_and_streams(server, sdk, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "What is the capital of France?"}]
    out = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True, top_logprobs=3,
                                      extra_body={"return_token_ids": True})
    assert out.prompt_token_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert [e.logprob for e in choice.logprobs.content] and len(choice.logprobs.content) == len(choice.token_ids)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)

    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=11, stream=True,
                                         stream_options={"include_usage": True})
    text, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, seed=11)
    assert text == {c.index: c.message.content for c in whole.choices}  # the same seed samples the same
    assert set(finish) == {0, 1} and usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_the_text_but_not_the_token_ids(server, sdk):
    base = sdk.completions.create(model=MODEL, prompt="SELECT name FROM", max_tokens=8, seed=5,
                                  extra_body={"return_token_ids": True})
    text = base.choices[0].text
    found = re.search(r"[A-Za-z0-9]{2}", text[1:])  # whole characters (a random model's bytes may not be)
    assert found, f"no stop string to pick from {text!r}"
    stop = found.group()
    out = sdk.completions.create(model=MODEL, prompt="SELECT name FROM", max_tokens=8, seed=5, stop=[stop],
                                 extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[: text.find(stop)]
    assert choice.token_ids == base.choices[0].token_ids[: len(choice.token_ids)]


def test_the_token_route_speaks_vllms_own_schema(server):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse
    from vllm.sampling_params import SamplingParams

    url, backend = server
    prompt = [11, 42, 7, 99, 5]
    request = GenerateRequest(token_ids=prompt, model=MODEL,
                              sampling_params=SamplingParams(n=2, max_tokens=4, temperature=1.0, logprobs=1, seed=2))
    raw = httpx.post(f"{url}/inference/v1/generate", json=request.model_dump(mode="json"), timeout=60)
    assert raw.status_code == 200, raw.text
    response = GenerateTokensResponse.model_validate(raw.json())
    assert response.request_id == request.request_id and response.prompt_token_ids == prompt
    assert len(response.choices) == 2
    for choice in response.choices:
        assert len(choice.logprobs.content) == len(choice.token_ids) <= 4
        assert [e.token_id for e in choice.logprobs.content] == choice.token_ids
        assert choice.weight_versions[0].version == str(backend.weight_version)
        # the sampled token's rank in the distribution it was drawn from: its top-1 alternative's log-prob is
        # above it, or it is that alternative
        for entry in choice.logprobs.content:
            best = entry.top_logprobs[0]
            assert entry.rank >= 1 and (entry.rank == 1) == (best.token_id == entry.token_id or best.logprob
                                                              <= entry.logprob), entry
        # PrimeRL's renderers client reads each entry's token as "token_id:<id>".
    assert all(e["token"] == f"token_id:{e['token_id']}" for c in raw.json()["choices"] for e in c["logprobs"]["content"])
    # prime-rl's orchestrator adds these to every policy request's sampling_params (renderers forwards them).
    primerl = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 3, "top_k": -1, "min_p": 0.0, "return_token_ids": True,
               "cache_salt": "3", "stop_token_ids": [0], "logprobs": 1, "skip_special_tokens": False}
    raw = httpx.post(f"{url}/inference/v1/generate", json={"model": MODEL, "token_ids": prompt, "sampling_params": primerl},
                     timeout=60)
    assert raw.status_code == 200, raw.text
    assert 1 <= len(raw.json()["choices"][0]["token_ids"]) <= 3


def test_tokenize_and_detokenize_as_vllm_answers_them(server, tiny_model):
    from transformers import AutoTokenizer
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeResponse, TokenizeResponse

    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = TokenizeResponse.model_validate(httpx.post(f"{url}/tokenize", json={"messages": messages}).json())
    assert chat.tokens == tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert chat.count == len(chat.tokens) and chat.max_model_len == 256
    text = TokenizeResponse.model_validate(httpx.post(f"{url}/tokenize", json={
        "prompt": "Paris is the capital", "return_token_strs": True}).json())
    assert text.tokens == tokenizer("Paris is the capital")["input_ids"] and "".join(text.token_strs) == "Paris is the capital"
    back = DetokenizeResponse.model_validate(httpx.post(f"{url}/detokenize", json={"tokens": text.tokens}).json())
    assert back.prompt == "Paris is the capital"
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


def test_bad_input_is_a_4xx_in_openais_error_shape(server, sdk):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as err:
        sdk.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, presence_penalty=0.5)
    assert err.value.body["param"] == "presence_penalty" and "cannot apply" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the transformers sampler has no grammar engine
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"structured_outputs": {"choice": ["a"]}})
    assert err.value.body["param"] == "structured_outputs" and "cannot apply" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # named by the field that brought the constraint
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"mirostat": 1})
    assert err.value.body["param"] == "mirostat"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert err.value.body["param"] == "messages" and "chat template" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=2)
    assert err.value.body["param"] == "prompt"
    token_route = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": [1, -1], "sampling_params": {}})
    assert token_route.status_code == 400 and token_route.json()["error"]["param"].startswith("token_ids")
    token_route = httpx.post(f"{url}/inference/v1/generate",
                             json={"token_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.1}})
    assert token_route.status_code == 400 and token_route.json()["error"]["param"] == "sampling_params.frequency_penalty"
    token_route = httpx.post(f"{url}/inference/v1/generate",
                             json={"token_ids": [1, 2], "sampling_params": {"logit_bias": {"5": 1.0}}})
    assert token_route.status_code == 400 and token_route.json()["error"]["param"] == "sampling_params.logit_bias"
    with pytest.raises(openai.BadRequestError) as err:  # a request never brings its own template
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' * 10**9 }}"}})
    assert err.value.body["param"] == "chat_template_kwargs.chat_template"
    hi = [{"role": "user", "content": "hi"}]
    for extra, param in [  # vLLM's fields, each refused by name where it cannot be honoured
            ({"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}, "repetition_detection"),  # sampler
            ({"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, "repetition_detection.min_count"),
            ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt true
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
            ({"kv_transfer_params": {"prompt_token_ids": [1, 2]}}, "kv_transfer_params.prompt_token_ids"),
            ({"media_io_kwargs": {"video": {"fps": 1}}}, "media_io_kwargs"),
            ({"reasoning_effort": "extreme"}, "reasoning_effort"),
            ({"routed_experts_prompt_start": 10**6}, "routed_experts_prompt_start")]:
        with pytest.raises(openai.BadRequestError) as err:
            sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=2, extra_body=extra)
        assert err.value.body["param"] == param, (extra, err.value.body)
    big = httpx.post(f"{url}/tokenize", json={"prompt": "x" * (65 * 2**20)}, timeout=60)
    assert big.status_code == 413 and "serving_body_bytes" in big.json()["error"]["message"]
    over = sdk.completions.with_raw_response  # a cap of the server's, named by the route's own field
    with pytest.raises(openai.APIStatusError) as err:
        over.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert err.value.status_code == 413 and err.value.body["param"] == "max_tokens"
    with pytest.raises(Exception) as err:
        ArcticRLClient(url, retries=0).episode("never-recorded")
    assert "never-recorded" in str(err.value)
    assert httpx.post(f"{url}/v1/episode", json={"session": "never-recorded"}).status_code == 404


def test_update_weights_syncs_and_completions_report_the_new_version(server, sdk):
    url, backend = server
    backend.fwd_bwd([{"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "advantages": [1.0, 1.0]}], "sft")
    backend.step()
    before = backend.weight_version
    answer = httpx.post(f"{url}/update_weights", timeout=60).json()
    assert answer["weight_version"] == before + 1 == backend.weight_version
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": str(before + 1)}
    out = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.choices[0].weight_versions[0]["version"] == str(before + 1)
    assert httpx.get(f"{url}/get_world_size").json() == {"world_size": 1}
    refused = httpx.post(f"{url}/update_weights", json={"update_info": {"names": ["x"]}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "update_info"
    # prime-rl's orchestrator names the folder it saw published: the weights are already here, nothing is synced
    # or read from it.
    named = httpx.post(f"{url}/update_weights", json={"weight_dir": "/nonexistent/broadcasts/step_3"}, timeout=60)
    assert named.status_code == 200 and named.json()["weight_version"] == before + 1 == backend.weight_version
    refused = httpx.post(f"{url}/update_weights", json={"weight_dir": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight_dir"


def test_concurrent_requests_are_sampled_in_one_call_each_answered_on_its_own(server, server_thread):
    url, backend = server
    job = server_thread.app.state.job
    coalescer = server_thread.app.state.serving.coalescer(backend, job.reads)  # the one the routes use
    calls = []
    real = backend.sampler.generate

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        deadline = time.monotonic() + 30  # the sampler is busy until every request arrived: they gather meanwhile
        while len(calls) == 1 and coalescer.requests < arrived + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(prompts, *args, **kwargs)
    arrived = coalescer.requests
    backend.sampler.generate = counted
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(8)] + [[1, 2, 10**6]]  # the last is out of the vocabulary
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": p, "max_tokens": 3, "return_token_ids": True}), prompts))
    finally:
        backend.sampler.generate = real
    assert [a.status_code for a in answers] == [200] * 8 + [400]
    assert answers[-1].json()["error"]["param"] == "prompt"  # refused on its own: it never joined a batch
    for prompt, answer in zip(prompts, answers[:8]):
        [choice] = answer.json()["choices"]
        assert choice["prompt_token_ids"] == prompt and 1 <= len(choice["token_ids"]) <= 3
    assert sum(calls) == 8 and len(calls) <= 2, calls  # those that came during the first call are one call after it


def _slow_generate(backend, gate):
    """The sampler's calls wait until the test opens `gate` (a long generation), without changing what they
    return. Returns (entered, restore): `entered` is set once a call is waiting at the gate; `restore` opens the
    gate and puts the real sampler back."""
    real = backend.sampler.generate
    entered = threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        assert gate.wait(60), "the test never opened the gate"  # only bounds a hang
        return real(*args, **kwargs)
    backend.sampler.generate = slow

    def restore():
        gate.set()
        backend.sampler.generate = real
    return entered, restore


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()))
    thread.start()
    return thread, box


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_aborts_or_drains_in_flight_requests_and_holds_new_ones(server, mode):
    url, backend = server
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "return_token_ids": True}
    gate = threading.Event()  # the request in flight is being sampled until the test sets it
    entered, restore = _slow_generate(backend, gate)
    try:
        flight, box = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60).json())
        assert entered.wait(30)  # the request is being sampled
        # The pause's answer, and whether the sampling had been let go by the time it came.
        pausing, paused = _in_thread(lambda: (httpx.post(f"{url}/pause", params={"mode": mode}, timeout=60).json(),
                                              gate.is_set()))
        if mode == "wait":
            pausing.join(0.5)  # a short look: it can only miss a pause that came back too early, never fail a right one
            assert pausing.is_alive(), "pause(wait) returned while a request was still being sampled"
            gate.set()
        pausing.join(timeout=30)
        assert not pausing.is_alive(), f"pause({mode}) waited for the request in flight"
        answer, sampling_was_let_go = paused["out"]
        # abort and keep answer while the sampling is still held; wait answers only once it ended
        assert answer == {"status": "paused"} and sampling_was_let_go == (mode == "wait")
        assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
        if mode == "abort":
            flight.join(timeout=30)  # answered at once: the sampling is still held
            assert not flight.is_alive()
            choice = box["out"]["choices"][0]
            assert choice["finish_reason"] == "abort" and choice["token_ids"] == []
        elif mode == "keep":
            assert flight.is_alive()  # kept: it is still being sampled
        gate.set()
        flight.join(timeout=30)
        assert not flight.is_alive()
        if mode != "abort":
            choice = box["out"]["choices"][0]
            assert choice["finish_reason"] in ("stop", "length") and choice["token_ids"]
        held, held_box = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60).json())
        held.join(0.3)  # a short look: it can only miss a request that was let through, never fail a held one
        assert held.is_alive(), "a request that arrived while paused must wait for resume"
        assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
        held.join(timeout=30)
        assert not held.is_alive()
        assert held_box["out"]["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        restore()
        httpx.post(f"{url}/resume")
    assert httpx.get(f"{url}/v1/status").json()["serving"]["paused"] is False


def test_what_vllm_serve_also_answers_ping_version_tools_under_none_and_an_agents_sampling(server, sdk):
    url, _ = server
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    version = httpx.get(f"{url}/version").json()
    assert version["version"] and version["arctic_rl"]
    # tool_choice "none" keeps the tools in the rendered prompt, as vLLM renders it: only the calls are off
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                               "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Define RL."}]

    def prompt(**extra):
        return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": messages, "max_tokens": 1, "return_token_ids": True, **extra}).json()["prompt_token_ids"]
    plain, offered, declined = prompt(), prompt(tools=tools, tool_choice="auto"), prompt(tools=tools, tool_choice="none")
    assert declined == offered and len(offered) > len(plain)
    # an agent's usual sampling, nothing of ours in the request: accepted, log-probs reported for each token
    out = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0.7, top_p=0.95, max_tokens=6,
                                      logprobs=True, extra_body={"return_token_ids": True})
    assert len(out.choices[0].logprobs.content) == len(out.choices[0].token_ids) > 0


def test_routes_are_counted_in_status_and_need_the_token_off_loopback(tiny_model):
    config = BackendConfig.model_validate({"model_path": tiny_model, "sampler": LIGHT_SAMPLER})
    with ServerThread(ServerSettings(port=free_loopback_port(), token="s3cret"), config) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            sdk.models.list()
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        [card] = sdk.models.list().data
        assert card.id == tiny_model and card.max_model_len == 256
        sdk.completions.create(model=tiny_model, prompt="hi", max_tokens=2)
        sdk.chat.completions.create(model=tiny_model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        headers = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/health", headers=headers).status_code == 200
        status = httpx.get(f"{url}/v1/status", headers=headers).json()
        assert status["serving"]["requests"] == {"completions": 1, "chat": 1, "generate": 0}
        assert status["backend"]["generated"]["calls"] == 2  # the same sampler as the training API's generate
    assert json.dumps(status)  # plain JSON


def test_chat_with_a_tool_call_parser_answers_tool_calls_from_the_sampled_tokens(tiny_model):
    """The sampler answers with a tool call (as a tool-trained model would); the message carries it as
    tool_calls, the token ids are the sampled ones, and streaming gives the same call."""
    from transformers import AutoTokenizer

    from arctic_rl_core.types import Completion

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    reply = tokenizer('Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>')["input_ids"]
    config = BackendConfig.model_validate({"model_path": tiny_model, "sampler": LIGHT_SAMPLER})
    thread = ServerThread(ServerSettings(port=free_loopback_port(), tool_call_parser="hermes"), config)
    backend = thread.app.state.job.api
    backend.sampler.generate = lambda prompts, sampling, version: [
        Completion(prompt_index=0, token_ids=reply, logprobs=[-1.0] * len(reply), finish_reason="stop",
                   weight_version=version) for _ in range(sampling.n)]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1 + 2?"}]
    with thread as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = sdk.chat.completions.create(model=tiny_model, messages=messages, tools=tools, max_tokens=40,
                                          extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
        assert choice.token_ids == reply
        streamed = list(sdk.chat.completions.create(model=tiny_model, messages=messages, tools=tools, max_tokens=40,
                                                    stream=True))
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        calls = [call for d in deltas for call in d.tool_calls or []]
        # vLLM's stream: the content before the call, the call's id and name once, then its arguments in pieces
        assert "".join(d.content or "" for d in deltas) == "Sure."
        assert [call.function.name for call in calls if call.function.name] == ["add"]
        assert [call.id for call in calls if call.id] == [calls[0].id] and calls[0].id.startswith("chatcmpl-tool-")
        assert json.loads("".join(call.function.arguments or "" for call in calls)) == {"a": 1, "b": 2}
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        # a forced call needs vLLM's grammar engine (its structural tag), which this sampler has not
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=tiny_model, messages=messages, tools=tools, tool_choice="required")
        assert refused.value.body["param"] == "tools"
        plain = sdk.chat.completions.create(model=tiny_model, messages=messages, max_tokens=40)  # no tools: text
        assert plain.choices[0].message.tool_calls is None and "add" in plain.choices[0].message.content


def test_pause_abort_ends_the_samplers_call_in_flight_so_a_weight_sync_need_not_wait(tiny_model):
    config = BackendConfig.model_validate({"model_path": tiny_model, "sampler": LIGHT_SAMPLER,
                                           "engine": {"learning_rate": 1e-2}})
    thread = ServerThread(ServerSettings(port=free_loopback_port()), config)
    backend = thread.app.state.job.api
    model, steps = backend.sampler.model, []
    real_forward = model.forward
    stop_at, stopped, go_on = 10, threading.Event(), threading.Event()

    def held_forward(*args, **kwargs):  # one token a step; the call sampling holds at its 10th until told to go on
        steps.append(1)
        if len(steps) == stop_at:
            stopped.set()
            assert go_on.wait(60), "the test never let the sampler go on"  # only bounds a hang
        return real_forward(*args, **kwargs)
    with thread as url:
        model.forward = held_forward
        calls_before = backend.generated["calls"]
        body = {"model": tiny_model, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 200, "return_token_ids": True}
        flight, box = _in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60).json())
        direct, direct_box = _in_thread(lambda: backend.generate([[5, 6, 7]], {"max_tokens": 200, "n": 2}))
        try:
            # Both calls are in generate before the pause: one sampling (held at its 10th token), the other waiting
            # for the sampler (this sampler takes one call at a time).
            assert stopped.wait(30)
            deadline = time.monotonic() + 30  # only bounds a hang
            while backend._sampler_lock._waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert backend._sampler_lock._waiting == 1
            httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=30)
        finally:
            go_on.set()
        version = httpx.post(f"{url}/update_weights", timeout=60).json()["weight_version"]
        sampled_by_the_sync = len(steps)
        flight.join(timeout=60)
        direct.join(timeout=60)
        assert [c["finish_reason"] for c in box["out"]["choices"]] == ["abort", "abort"]
        assert version == 1
        # The sync did not wait for either call to run on: when it was done, the sampler had sampled about the
        # tokens it had when the pause came, far from the 200 of one call that ran to its end.
        assert sampled_by_the_sync < 50, sampled_by_the_sync
        deadline = time.monotonic() + 30  # the request's call, whose answer the route dropped, ends too: soon
        while backend.generated["calls"] < calls_before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.generated["calls"] == calls_before + 2 and len(steps) < 50, len(steps)
        # A generate call of the training API in flight was cut too: what it sampled so far, finish reason abort.
        for c in direct_box["out"]:
            assert c.finish_reason == "abort" and len(c.token_ids) < 200 and len(c.logprobs) == len(c.token_ids)
        httpx.post(f"{url}/resume")
        model.forward = real_forward
        after = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 3}, timeout=60).json()
        assert {c["finish_reason"] for c in after["choices"]} <= {"stop", "length"}
        assert all(c["weight_versions"][0]["version"] == "1" for c in after["choices"])


def test_vllms_prompt_fields_shape_the_prompt_the_sampler_sees(server):
    url, _ = server
    messages = [{"role": "user", "content": "Name the weather in Paris."}, {"role": "assistant", "content": "It is"}]

    def chat(**extra) -> dict:
        response = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": messages[:1], "max_tokens": 3, "temperature": 0, "return_token_ids": True,
            **extra})
        assert response.status_code == 200, response.text
        return response.json()

    whole = chat(return_prompt_text=True)
    full = whole["prompt_token_ids"]
    tokenized = httpx.post(f"{url}/tokenize", json={"prompt": whole["prompt_text"], "add_special_tokens": False}).json()
    assert tokenized["tokens"] == full and whole["prompt_text"].endswith("<|im_start|>assistant\n")
    assert chat(truncate_prompt_tokens=5)["prompt_token_ids"] == full[-5:]
    assert chat(truncate_prompt_tokens=5, truncation_side="right")["prompt_token_ids"] == full[:5]
    assert chat(truncate_prompt_tokens=200)["prompt_token_ids"] == full  # longer than the prompt: as it is
    # the last message continued: rendered open, so the prompt ends with its text
    continued = chat(messages=messages, add_generation_prompt=False, continue_final_message=True, return_prompt_text=True)
    assert continued["prompt_text"].endswith("It is") and continued["choices"][0]["message"]["role"] == "assistant"
    # echo: the last message's content before the reply's where it has the reply's role, and the prompt's log-probs
    echoed = chat(messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True)
    assert echoed["choices"][0]["message"]["content"].startswith("It is")
    assert len(echoed["prompt_logprobs"]) == len(echoed["prompt_token_ids"])
    # without a generation prompt the reply's role is the last message's
    assert chat(messages=messages[:1], add_generation_prompt=False)["choices"][0]["message"]["role"] == "user"
    with_documents = chat(documents=[{"title": "Paris", "text": "Sunny."}], reasoning_effort="low", priority=3,
                          watermarking=True, vllm_xargs={"note": 1}, return_token_offsets=True)
    assert with_documents["choices"][0]["finish_reason"] in ("stop", "length")
