"""`sampler.replicas: 2`: two samplers as Ray actors behind the one API. After sync_weights every replica
scores the trainer's log-probs; a replica killed mid-generate loses no request and is replaced at the
current weight version; a placement the cluster cannot satisfy fails naming the setting."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.run import ServerThread
from arctic_rl_core.types import SamplingParams
from tests.vllm_scenarios import _wait_until, engine_metrics

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9], [20, 21, 22, 23], [5, 6, 7, 8, 9], [30, 31]]
"""Prompt 0 three times (a GRPO group sent as copies), three other prompts."""


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def trained_and_synced(api: InProcessBackend) -> list[dict]:
    """Generate, one GRPO step, sync: the sequences generated."""
    out = api.generate(PROMPTS, {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7})
    seqs = [{"prompt_ids": PROMPTS[c.prompt_index], "response_ids": c.token_ids, "group_id": c.prompt_index % 3,
             "advantages": [1.0 - (c.prompt_index % 2)] * len(c.token_ids), "behaviour_logprobs": c.logprobs}
            for c in out]
    api.fwd_bwd(seqs, "grpo")
    api.step()
    assert api.sync_weights() == 1
    return seqs


@pytest.mark.parametrize("sync", ["shared_memory", "broadcast"])  # object store; gloo group from trainer rank 0
def test_two_vllm_replicas_and_two_ranks_colocated_score_the_trainers_logprobs_after_sync(tiny_model, sync):
    api = InProcessBackend({
        "model_path": tiny_model, "placement": "colocated",
        "engine": {"ranks": 2, "zero_stage": 3, "learning_rate": 1e-2},
        "sampler": {"name": "vllm", "replicas": 2, "kv_cache_mb": 64, "max_model_len": 256, "sync": sync},
        "ray": {"num_cpus": 2},  # rank i and replica i share bundle i: two CPUs hold all four actors
    })
    import ray

    try:
        out = api.generate(PROMPTS, {"n": 2, "max_tokens": 6, "seed": 1})
        assert sorted(c.prompt_index for c in out) == sorted(list(range(len(PROMPTS))) * 2)
        deal = api.sampler.last_deal
        assert len(deal) == 2, deal  # both replicas worked
        holder = [replica for replica, indexes in deal.items() if 0 in indexes]
        assert len(holder) == 1 and {0, 2, 4} <= set(deal[holder[0]]), deal  # the copies of prompt 0 stayed together

        seqs = trained_and_synced(api)
        assert api.describe()["sync_route"].startswith({"shared_memory": "object_store", "broadcast": "broadcast"}[sync])
        trainer = api.log_probs(seqs).logprobs
        pairs = [(s["prompt_ids"], s["response_ids"]) for s in seqs]
        for slot in api.sampler._slots:
            assert max_gap(ray.get(slot.actor.score.remote(pairs)), trainer) < 1e-3
        assert max_gap(api.log_probs(seqs, source="sampler").logprobs, trainer) < 1e-3
        assert {c.weight_version for c in api.generate(PROMPTS[:2], {"max_tokens": 3})} == {1}

        status = api.describe()
        assert [(row["rank"], row["bundle"]) for row in status["trainer"]] == [(0, 0), (1, 1)]
        assert [(row["replica"], row["bundle"], row["healthy"], row["weight_version"])
                for row in status["sampler"]] == [(0, 0, True, 1), (1, 1, True, 1)]
        assert len({row["pid"] for row in status["trainer"] + status["sampler"]}) == 4

        # A sync while the pool samples: it waits for no call in flight; every sample goes on under the new weights,
        # its replica recording which version sampled which token, and the new span is the new weights' model.
        assert api.describe()["crosses_syncs"]
        api.fwd_bwd(seqs, "grpo")
        api.step()
        box, prompts = {}, [PROMPTS[1], PROMPTS[3], PROMPTS[5], [40, 41, 42]]
        running = threading.Thread(target=lambda: box.setdefault("out", api.generate(
            prompts, {"n": 2, "max_tokens": 120, "ignore_eos": True})))
        running.start()
        _wait_until(lambda: sum(n > 0 for slot in api.sampler._slots  # every sample has its first tokens
                                for n in ray.get(slot.actor.samples_in_flight.remote())) == 8)
        assert api.sync_weights() == 2
        running.join(300)
        crossed = box["out"]
        assert len(crossed) == 8 and {len(c.token_ids) for c in crossed} == {120}
        assert all(c.token_versions is not None and set(c.token_versions) == {1, 2}
                   and c.token_versions == sorted(c.token_versions) for c in crossed)
        at_v2 = api.log_probs([{"prompt_ids": prompts[c.prompt_index], "response_ids": c.token_ids}
                               for c in crossed]).logprobs
        assert max(abs(a - b) for c, t in zip(crossed, at_v2)
                   for a, b, v in zip(c.logprobs, t, c.token_versions) if v == 2) < 1e-3

        # A replica's vLLM engine takes concurrent calls into one running batch: a short call sent after a long
        # one on the same replica returns first.
        replica = api.sampler._slots[0].actor
        long = replica.generate.remote([PROMPTS[1]], SamplingParams(max_tokens=200, min_tokens=200, ignore_eos=True))
        short = replica.generate.remote([PROMPTS[3]], SamplingParams(max_tokens=2))
        [first], _ = ray.wait([long, short], num_returns=1, timeout=300)
        assert first == short and len(ray.get(long)[0].token_ids) == 200

        # The serving routes on the same pool: each request its own call (the replicas batch them), dealt to the
        # replicas, captured.
        server = ServerThread(ServerSettings(port=free_loopback_port()), api.config, backend_factory=lambda c: api)
        with server as url:
            def ask(i):
                return httpx.post(f"{url}/v1/completions", timeout=120, headers={"X-Session-Id": f"s{i}"}, json={
                    "model": tiny_model, "prompt": PROMPTS[i], "max_tokens": 4, "logprobs": 2,
                    # Top log-probs are keyed by token text, where two tokens of the random model can decode
                    # alike: keyed by id, each of the 2 asked for is its own entry.
                    "return_token_ids": True, "return_tokens_as_token_ids": True}).json()
            with ThreadPoolExecutor(len(PROMPTS)) as threads:
                answers = list(threads.map(ask, range(len(PROMPTS))))
            for i, answer in enumerate(answers):
                [choice] = answer["choices"]
                assert choice["weight_versions"][0]["version"] == "2"
                assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"])
                [turn] = api.episode(f"s{i}").turns
                assert (turn.prompt_ids, turn.token_ids) == (PROMPTS[i], choice["token_ids"])
            assert server.app.state.serving.describe()["generate_calls"] == len(PROMPTS)

            # `stream: true` through the pool: token ids arrive in pieces as a replica's engine samples them, the
            # first while the replica still samples; together they are the reply's.
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": tiny_model, "prompt": PROMPTS[3], "max_tokens": 96, "ignore_eos": True, "stream": True,
                    "return_token_ids": True, "stream_options": {"include_usage": True}}) as response:
                events, sampling_at = [], []
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: "):]))
                        sampling_at.append(sum(n > 0 for slot in api.sampler._slots
                                               for n in ray.get(slot.actor.samples_in_flight.remote())))
            pieces = [i for i, e in enumerate(events) if e["choices"] and e["choices"][0]["token_ids"]]
            ids = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"] or []]
            assert len(pieces) > 4 and sampling_at[pieces[0]] > 0, (len(pieces), sampling_at)
            assert len(ids) == 96 and [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [96]
            # /metrics: each replica's vLLM families, told apart by their engine label, as one exposition.
            tokens = {engine: counters.get("vllm:generation_tokens", 0)
                      for engine, (_, counters, _) in engine_metrics(url).items()}
            assert set(tokens) == {"0", "1"} and min(tokens.values()) > 0, tokens  # both replicas sampled

            # A stream its client closes after 3 pieces: the replica sampling it ends the call, as one sampler does.
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": tiny_model, "prompt": PROMPTS[2], "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}) as response:
                pieces = 0
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        pieces += 1
                        if pieces == 3:
                            break
            _wait_until(lambda: not any(ray.get(slot.actor.samples_in_flight.remote()) for slot in api.sampler._slots),
                        timeout_s=60)
            sampled = sum(counters.get("vllm:generation_tokens", 0) for _, counters, _ in engine_metrics(url).values())
            assert sampled - sum(tokens.values()) < 750, (sampled, tokens)  # ended early, not at 1,500 tokens
    finally:
        api.close()
    assert not ray.is_initialized()


@pytest.mark.parametrize("sync", ["shared_memory", "broadcast"])  # replaced from the object store; from a peer
def test_a_replica_killed_mid_generate_loses_no_request_and_is_replaced_at_the_current_version(tiny_model, sync):
    import ray

    api = InProcessBackend({"model_path": tiny_model, "engine": {"learning_rate": 1e-2},
                            "sampler": {"name": "transformers", "replicas": 2, "sync": sync}, "ray": {"num_cpus": 2}})
    pool = api.sampler
    try:
        seqs = trained_and_synced(api)
        victim = pool._slots[0]
        first_pid = victim.facts["pid"]
        prompts = [[3 + i, 40 + i, 7, 9 + i] for i in range(24)]
        # Long enough (every sample runs its 160 tokens) that the kill lands inside the victim's generate on an
        # idle machine too: 48 tokens once finished within the second waited below.
        sampling = {"n": 2, "max_tokens": 160, "min_tokens": 160, "temperature": 1.0, "seed": 3}
        calls = ThreadPoolExecutor(1)
        answer = calls.submit(api.generate, prompts, sampling)
        deadline = time.monotonic() + 60
        while victim.queued_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # inside the replica's generate
        ray.kill(victim.actor, no_restart=True)
        out = answer.result(timeout=300)
        calls.shutdown()
        assert pool.redealt >= 1  # the kill interrupted work that was dealt again
        counts = [sum(c.prompt_index == i for c in out) for i in range(len(prompts))]
        assert counts == [2] * len(prompts)  # every request answered, none twice
        assert {c.weight_version for c in out} == {1}

        assert pool.wait_healthy(timeout=180)
        rows = api.describe()["sampler"]
        assert [(r["state"], r["weight_version"]) for r in rows] == [("ready", 1), ("ready", 1)]
        assert rows[0]["pid"] != first_pid and rows[0]["replacements"] == 1
        # The replacement holds the synced weights, not the checkpoint's.
        pairs = [(s["prompt_ids"], s["response_ids"]) for s in seqs]
        assert max_gap(ray.get(victim.actor.score.remote(pairs)), api.log_probs(seqs).logprobs) < 1e-3
        # The next sync reaches the replacement too (on the broadcast route: a group formed again).
        api.fwd_bwd(seqs, "grpo")
        api.step()
        assert api.sync_weights() == 2
        trainer = api.log_probs(seqs).logprobs
        for slot in pool._slots:
            assert max_gap(ray.get(slot.actor.score.remote(pairs)), trainer) < 1e-3
    finally:
        api.close()


def test_a_sampler_pool_the_cluster_cannot_place_fails_at_start_naming_the_setting(tiny_model):
    import ray

    cfg = {"model_path": tiny_model, "placement": "disaggregated", "engine": {"ranks": 2},
           "sampler": {"name": "transformers", "replicas": 2}, "ray": {"num_cpus": 3}}
    with pytest.raises(InvalidRequest) as err:
        InProcessBackend(cfg)
    assert err.value.field == "sampler.replicas" and "2 CPU needed, the cluster has 3 (1 free)" in str(err.value)
    assert not ray.is_initialized()  # nothing left: no actors, no placement groups, no local Ray


def test_a_replica_that_dies_after_streaming_tokens_fails_the_call_and_the_others_are_dealt_again():
    """Tokens heard cannot be taken back: a streamed share whose replica dies after some of its tokens went out is
    not sampled again elsewhere (the call fails, naming why), while a share that had streamed nothing is."""
    import os

    import ray

    from arctic_rl_core.samplers.sampler_pool import SamplerPool, SamplerReplicaFailed, _Slot

    @ray.remote(max_concurrency=4)
    class Replica:
        def __init__(self, dies_after_tokens: bool):
            self.dies_after_tokens = dies_after_tokens

        def generate_stream(self, prompts, sampling):
            if self.dies_after_tokens:
                yield "tokens", [(0, 0, [7, 8])]
                time.sleep(0.3)
            os._exit(1)

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        for dies_after_tokens in (True, False):
            pool = SamplerPool.__new__(SamplerPool)  # its dealing alone, on stand-in replicas
            pool._changed, pool.redealt = threading.Condition(), 0
            pool.config = SimpleNamespace(ray=SimpleNamespace(start_timeout_s=0.5))  # how long dealing waits
            pool._slots = [_Slot(0)]
            pool._slots[0].state, pool._slots[0].actor = "ready", Replica.remote(dies_after_tokens)
            heard, lost = [], []
            pool._lost = lambda slot, actor, reason: (lost.append(reason), setattr(slot, "state", "replacing"))
            units = SamplerPool._by_prompt([[1, 2, 3]], lambda ix: 10)
            with pytest.raises(SamplerReplicaFailed, match="after streaming tokens" if dies_after_tokens
                               else "no sampler replica is ready"):
                pool._run(units, lambda actor, ix: actor.generate_stream.options(num_returns="streaming").remote(
                    [[1, 2, 3]], None), lambda indexes, tokens: heard.append(tokens))
            assert lost == ["ActorDiedError"] and pool._slots[0].queued_tokens == 0
            assert heard == ([[(0, 0, [7, 8])]] if dies_after_tokens else [])
            assert pool.redealt == (0 if dies_after_tokens else 1)  # the silent share was dealt again
    finally:
        ray.shutdown()


def test_a_pool_serves_each_adapter_on_every_replica_and_a_replacement_loads_them(tiny_model, tmp_path):
    """sampler.adapters on two vLLM replicas: requests naming an adapter are dealt to both, each sampled as the
    trainer holding that adapter scores it; a replica that dies is replaced with the adapters the pool serves."""
    import ray

    from tests.helpers import grpo_batch

    api = InProcessBackend({"model_path": tiny_model, "engine": {"learning_rate": 1e-2, "lora": {"r": 8}},
                            "sampler": {"name": "vllm", "replicas": 2, "kv_cache_mb": 64, "max_model_len": 256,
                                        "adapters": 2}, "ray": {"num_cpus": 2}})
    pool = api.sampler
    try:
        for _ in range(2):
            api.fwd_bwd(grpo_batch(groups=2, group_size=2, vocab=api.engine.vocab_size), "grpo")
            api.step()
        api.save_adapter(str(tmp_path / "t1"))
        api.add_adapter("t1", str(tmp_path / "t1"))

        def gap_to_trainer(sampling) -> float:
            out = api.generate(PROMPTS, {"n": 2, "max_tokens": 8, "temperature": 1.0, **sampling})
            assert len(pool.last_deal) == 2, pool.last_deal  # both replicas sampled
            trainer = api.log_probs([{"prompt_ids": PROMPTS[c.prompt_index], "response_ids": c.token_ids}
                                     for c in out]).logprobs
            return max_gap([c.logprobs for c in out], trainer)

        assert gap_to_trainer({"adapter": "t1"}) < 1e-4
        assert gap_to_trainer({}) > 1e-2  # without it, the base model's samples
        ray.kill(pool._slots[0].actor, no_restart=True)
        _wait_until(lambda: len(pool._alive(pool._slots)) == 1)  # seen dead: replaced in the background
        assert pool.wait_healthy(timeout=180)
        assert pool._slots[0].replacements == 1
        assert gap_to_trainer({"adapter": "t1"}) < 1e-4  # the replacement serves t1 too
        api.remove_adapter("t1")
        with pytest.raises(InvalidRequest, match="sampling.adapter"):
            api.generate(PROMPTS, {"max_tokens": 2, "adapter": "t1"})
    finally:
        api.close()


def test_r3_completions_from_two_replicas_carry_their_routing_across_a_sync(tmp_path):
    """Router replay (R3) behind a pool: each replica's vLLM sampler records its completions' routing, which crosses
    Ray with them; after a step and a sync the replicas record under the new weights, and the trainer replaying each
    record gives the sampled log-probs."""
    import numpy as np

    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.types import Sequence, behaviour

    model = make_tiny_model("qwen3_moe", str(tmp_path / "moe"), max_positions=256)
    api = InProcessBackend({"model_path": model, "engine": {"learning_rate": 1e-2}, "router_replay": "R3",
                            "sampler": {"name": "vllm", "replicas": 2, "kv_cache_mb": 64}, "ray": {"num_cpus": 2}})
    try:
        for version in (0, 1):
            out = api.generate(PROMPTS, {"n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True})
            assert {c.weight_version for c in out} == {version}
            seqs = [Sequence(prompt_ids=PROMPTS[c.prompt_index], response_ids=c.token_ids, group_id=c.prompt_index,
                             advantages=[1.0 - (c.prompt_index % 2)] * len(c.token_ids), **behaviour(c)) for c in out]
            scored = api.log_probs(seqs)
            for c, taken, lp in zip(out, scored.routed_experts, scored.logprobs):
                assert c.routed_experts.tokens == len(PROMPTS[c.prompt_index]) + len(c.token_ids) - 1
                assert np.array_equal(taken.array()[: c.routed_experts.tokens], c.routed_experts.array())
                np.testing.assert_allclose(lp, c.logprobs, atol=2e-5)
            api.fwd_bwd(seqs, "grpo")
            api.step()
            assert api.sync_weights() == version + 1
        assert api.describe()["sampler"][0]["weight_version"] == 2
    finally:
        api.close()
