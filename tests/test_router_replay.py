"""Router replay through the training API (`router_replay`: R3, R2) on a tiny Qwen3-MoE: the sampler's routing
travels with its completions and every trainer forward over those tokens routes so; a bad record is refused by
name and changes nothing. Exactness against a plain masked-top-k reference, family by family, packed and padded:
tests/replay_sweep.py (run by tests/test_model_families.py)."""

import numpy as np
import pytest

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import RoutedExperts, Sequence, behaviour

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from arctic_rl_core.models.tiny import make_tiny_model

    return make_tiny_model("qwen3_moe", str(tmp_path_factory.mktemp("moe")), max_positions=256)


@pytest.fixture(scope="module")
def r3(moe_model):
    backend = InProcessBackend({"model_path": moe_model, "engine": {"learning_rate": 1e-2},
                                "sampler": {"name": "transformers"}, "router_replay": "R3"})
    yield backend
    backend.close()


def _sampled(backend, n=3, seed=1, max_tokens=6):
    completions = backend.generate([PROMPT], {"n": n, "max_tokens": max_tokens, "seed": seed, "ignore_eos": True})
    return completions, [Sequence(prompt_ids=PROMPT, response_ids=c.token_ids, group_id=0,
                                  advantages=[1.0 - i] * len(c.token_ids), **behaviour(c))
                         for i, c in enumerate(completions)]


def _other_routes(seq: Sequence, experts: int, seed: int) -> Sequence:
    """The same tokens routed to random other experts (distinct per token and layer)."""
    record = seq.routed_experts.array()
    rng = np.random.default_rng(seed)
    routes = np.argsort(rng.random((record.shape[0], record.shape[1], experts)), axis=-1)[..., : record.shape[2]]
    return seq.model_copy(update={"routed_experts": RoutedExperts.of(routes)})


def test_r3_completions_carry_the_sampler_routing_and_the_trainer_replays_it(r3):
    completions, seqs = _sampled(r3)
    replay = r3.engine.router_replay
    for c in completions:  # every forwarded token: the prompt and each sampled token but the last
        assert c.routed_experts.tokens == len(PROMPT) + len(c.token_ids) - 1
        assert (c.routed_experts.layers, c.routed_experts.top_k) == (replay.num_layers, replay.top_k)
    result = r3.log_probs(seqs)
    for taken, c, lp in zip(result.routed_experts, completions, result.logprobs):
        assert np.array_equal(taken.array()[: c.routed_experts.tokens], c.routed_experts.array())
        np.testing.assert_allclose(lp, c.logprobs, atol=2e-5)  # both fp32: the sampler's own log-probs


def test_replayed_routes_change_the_log_probs_and_are_the_routes_used(r3):
    _, seqs = _sampled(r3)
    native = r3.log_probs(seqs)
    forced = [_other_routes(s, r3.engine.router_replay.experts, seed=i) for i, s in enumerate(seqs)]
    replayed = r3.log_probs(forced)
    assert max(abs(a - b) for x, y in zip(native.logprobs, replayed.logprobs) for a, b in zip(x, y)) > 1e-3
    for taken, seq in zip(replayed.routed_experts, forced):
        assert np.array_equal(taken.array()[: seq.routed_experts.tokens], seq.routed_experts.array())


def test_zorro_on_and_off_give_the_same_results_with_replay(r3):
    _, seqs = _sampled(r3, n=4, seed=3)
    # The third sequence shares the prompt's tokens, not all its routing: the forest must not share those.
    seqs[2] = _other_routes(seqs[2], r3.engine.router_replay.experts, seed=7)
    results = {}
    for zorro in (True, False):
        r3.config.zorro.enable = zorro
        try:
            results[zorro] = r3.fwd_bwd(seqs, "grpo", return_logprobs=True)
            r3.discard_gradients()
        finally:
            r3.config.zorro.enable = True
    on, off = results[True], results[False]
    assert on.computed_tokens < off.computed_tokens  # the shared prompt computed once where routes agree
    np.testing.assert_allclose(np.concatenate(on.logprobs), np.concatenate(off.logprobs), atol=1e-5)
    assert on.loss == pytest.approx(off.loss, abs=1e-5)


def test_r2_the_old_policy_pass_routing_is_replayed_in_the_update(moe_model):
    backend = InProcessBackend({"model_path": moe_model, "engine": {"learning_rate": 5e-2},
                                "sampler": {"name": "transformers"}, "router_replay": "R2"})
    try:
        completions, seqs = _sampled(backend)
        assert all(c.routed_experts is None for c in completions)  # R2: the sampler records nothing
        old = backend.log_probs(seqs)  # the old-policy pass records its own routing
        replayed = [s.model_copy(update={"routed_experts": r}) for s, r in zip(seqs, old.routed_experts)]
        update = backend.fwd_bwd(replayed, "grpo", return_logprobs=True)
        np.testing.assert_allclose(np.concatenate(update.logprobs), np.concatenate(old.logprobs), atol=1e-5)
        backend.step()
        again = backend.log_probs(replayed)  # moved weights, the old routing still forced
        for taken, given in zip(again.routed_experts, old.routed_experts):
            assert np.array_equal(taken.array(), given.array())
    finally:
        backend.close()


@pytest.mark.parametrize("change, field", [
    (lambda r: {"ids": r.ids[: -r.layers * r.top_k], "layers": r.layers, "top_k": r.top_k}, "sequences[0].routed_experts"),
    (lambda r: {"ids": r.ids[:-1], "layers": r.layers, "top_k": r.top_k}, "sequences[0].routed_experts.ids"),
    (lambda r: {"ids": np.concatenate([r.ids, r.ids[: r.tokens * r.top_k]]), "layers": r.layers + 1, "top_k": r.top_k},
     "sequences[0].routed_experts.layers"),
    (lambda r: {"ids": r.array()[:, :, :1].reshape(-1), "layers": r.layers, "top_k": 1}, "sequences[0].routed_experts.top_k"),
    (lambda r: {"ids": np.where(np.arange(len(r.ids)) == 3, 4, r.ids), "layers": r.layers, "top_k": r.top_k},
     "sequences[0].routed_experts.ids"),  # expert 4 of 4
    (lambda r: {"ids": np.repeat(r.array()[..., :1], 2, axis=-1).reshape(-1), "layers": r.layers, "top_k": 2},
     "sequences[0].routed_experts.ids"),  # an expert twice
])
def test_a_bad_routing_record_is_refused_by_name_and_changes_nothing(r3, change, field):
    _, seqs = _sampled(r3)
    bad = seqs[0].model_copy(update={"routed_experts": RoutedExperts(**change(seqs[0].routed_experts))})
    before = r3.state_digest()
    for call in (lambda: r3.fwd_bwd([bad] + seqs[1:], "grpo"), lambda: r3.log_probs([bad])):
        with pytest.raises(InvalidRequest) as err:
            call()
        assert err.value.field == field
    assert not r3.engine.has_gradients and r3.state_digest() == before


def test_routes_without_replay_are_refused_not_ignored(moe_model, tiny_model):
    r3 = InProcessBackend({"model_path": moe_model, "sampler": {"name": "transformers"}, "router_replay": "R3"})
    try:
        _, seqs = _sampled(r3)
    finally:
        r3.close()
    for path, mode in ((moe_model, "off"), (tiny_model, "R3")):  # replay off; a dense model (it ignores the setting)
        backend = InProcessBackend({"model_path": path, "sampler": {"name": "transformers"}, "router_replay": mode})
        try:
            assert backend.engine.router_replay is None
            seq = seqs[0] if path == moe_model else Sequence(prompt_ids=[1] * len(PROMPT), response_ids=seqs[0].response_ids,
                                                              routed_experts=seqs[0].routed_experts)
            with pytest.raises(InvalidRequest) as err:
                backend.log_probs([seq])
            assert err.value.field == "sequences[0].routed_experts" and "ignored" in err.value.message
        finally:
            backend.close()


def test_routes_cross_the_wire(r3, moe_model, tmp_path):
    import base64
    import io

    import httpx

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    config = BackendConfig.model_validate({"model_path": moe_model, "sampler": {"name": "transformers"},
                                           "router_replay": "R3"})
    with ServerThread(ServerSettings(port=free_loopback_port(), checkpoint_dir=str(tmp_path)), config) as url:
        client = ArcticRLClient(url, retries=0)
        completions = client.generate([PROMPT], {"n": 2, "max_tokens": 5, "seed": 4, "ignore_eos": True})
        local, _ = _sampled(r3, n=2, seed=4, max_tokens=5)
        for remote, here in zip(completions, local):
            assert np.array_equal(remote.routed_experts.array(), here.routed_experts.array())
        seqs = [Sequence(prompt_ids=PROMPT, response_ids=c.token_ids, **behaviour(c)) for c in completions]
        result = client.log_probs(seqs)
        for taken, c in zip(result.routed_experts, completions):
            assert np.array_equal(taken.array()[: c.routed_experts.tokens], c.routed_experts.array())
        # The OpenAI routes send vLLM's own string: `.npy` bytes in base64, from routed_experts_prompt_start.
        for route, body in (("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            reply = httpx.post(f"{url}{route}", json={**body, "max_tokens": 4, "seed": 4, "ignore_eos": True,
                                                      "routed_experts_prompt_start": 2}, timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
            prompt_tokens = reply.json()["usage"]["prompt_tokens"]
            assert routes.dtype == np.uint8 and routes.shape == (prompt_tokens + 4 - 1 - 2, 2, 2), routes.shape


def test_the_token_route_returns_routes_as_prime_rl_reads_them_and_sessions_keep_them(moe_model, tmp_path):
    import base64

    import httpx

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    config = BackendConfig.model_validate({"model_path": moe_model, "sampler": {"name": "transformers"},
                                           "router_replay": "R3"})
    with ServerThread(ServerSettings(port=free_loopback_port(), checkpoint_dir=str(tmp_path)), config) as url:
        client = ArcticRLClient(url, retries=0)
        body = {"token_ids": PROMPT, "session_id": "episode-1",
                "sampling_params": {"max_tokens": 5, "seed": 2, "ignore_eos": True, "routed_experts_prompt_start": 2}}
        raw = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
        assert raw.status_code == 200, raw.text
        choice = raw.json()["choices"][0]
        payload = choice["routed_experts"]  # prime-rl's server's object, which its orchestrator decodes
        routes = np.frombuffer(base64.b64decode(payload["data"]), np.dtype(payload["dtype"])).reshape(payload["shape"])
        assert payload["start"] == 2 and payload["dtype"] == "uint8"
        assert routes.shape[0] == len(PROMPT) + len(choice["token_ids"]) - 1 - 2
        [turn] = client.episode("episode-1").turns
        assert np.array_equal(turn.routed_experts.array()[2:], routes)
        # The captured episode trains with the routing it was sampled with.
        [seq] = client.episode("episode-1").sequences(advantages=1.0)
        scored = client.log_probs([seq])
        assert np.array_equal(scored.routed_experts[0].array()[: turn.routed_experts.tokens], turn.routed_experts.array())
        np.testing.assert_allclose(scored.logprobs[0], turn.logprobs, atol=2e-5)
        bad = httpx.post(f"{url}/inference/v1/generate", json={
            **body, "sampling_params": {**body["sampling_params"], "routed_experts_prompt_start": len(PROMPT) + 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.routed_experts_prompt_start"


@pytest.mark.parametrize("replays", [True, False])
def test_the_reference_replays_only_where_the_job_asks(moe_model, replays):
    backend = InProcessBackend({"model_path": moe_model, "sampler": {"name": "transformers"}, "router_replay": "R3",
                                "reference": {"enable": True, "router_replay": replays}})
    try:
        _, seqs = _sampled(backend)
        forced = [_other_routes(s, backend.engine.router_replay.experts, seed=i) for i, s in enumerate(seqs)]
        own = backend.log_probs([s.model_copy(update={"routed_experts": None}) for s in seqs], source="reference")
        given = backend.log_probs(forced, source="reference")
        policy = backend.log_probs(forced)  # the policy is the reference's weights: replaying, the same numbers
        moved = max(abs(a - b) for x, y in zip(own.logprobs, given.logprobs) for a, b in zip(x, y))
        if replays:
            assert moved > 1e-3
            np.testing.assert_allclose(np.concatenate(given.logprobs), np.concatenate(policy.logprobs), atol=1e-5)
        else:
            assert moved < 1e-5  # its own routing (verl replays the policy only); packed otherwise, so not bit for bit
    finally:
        backend.close()


def test_the_critic_of_a_replaying_job_replays_the_routes_a_batch_carries(moe_model):
    """PPO with GAE under R3 (verl's critic worker on such a job): the critic's values and updates route a batch's
    tokens as its record says, and by its own routing where the batch carries none."""
    backend = InProcessBackend({"model_path": moe_model, "sampler": {"name": "transformers"}, "router_replay": "R3",
                                "critic": {"enable": True, "engine": {"learning_rate": 5e-2, "zero_stage": 0}}})
    try:
        _, seqs = _sampled(backend)
        own = [s.model_copy(update={"routed_experts": None}) for s in seqs]
        for step in range(2):  # its value head starts at zero (every value 0): a few steps move it
            targets = [s.model_copy(update={"returns": [1.0 - i] * len(s.response_ids), "old_values": v})
                       for i, (s, v) in enumerate(zip(seqs, backend.values(seqs).values))]
            backend.fwd_bwd(targets, "value", model="critic")
            backend.step(model="critic")
        replayed, unrouted = backend.values(seqs).values, backend.values(own).values
        forced = backend.values([_other_routes(s, backend.engine.router_replay.experts, seed=i)
                                 for i, s in enumerate(seqs)]).values
        assert [len(v) for v in unrouted] == [len(v) for v in replayed] == [len(s.response_ids) for s in seqs]
        assert any(abs(v) > 1e-3 for row in replayed for v in row)

        def gap(a, b):
            return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))
        assert gap(replayed, forced) > 1e-3  # the routes a batch carries are the ones taken
        # Its decoder trained too, so its own routing has left the sampler's: without a record the values differ.
        assert gap(replayed, unrouted) > 1e-3
    finally:
        backend.close()


def test_pipelined_rollouts_a_version_stale_replay_their_own_routing_on_the_newer_weights(moe_model):
    """Async pipelining (max_staleness 1) with R3: the batch trained after a step was sampled on the weights before
    it, and carries that sampler's routing; the trainer, on the newer weights, routes each of its tokens as the
    sampler did (the decoupled loss's behaviour terms then weigh the same routing), and trains on it."""
    from arctic_rl_core.pipeline import RolloutPipeline

    backend = InProcessBackend({"model_path": moe_model, "engine": {"learning_rate": 5e-2},
                                "sampler": {"name": "transformers"}, "router_replay": "R3"})
    pipeline = RolloutPipeline(backend, lambda step: [PROMPT], {"n": 4, "max_tokens": 6, "seed": 3, "ignore_eos": True},
                               max_staleness=1)
    stale, flips = [], []
    for _ in range(3):
        batch = pipeline.next_batch()
        seqs = [Sequence(prompt_ids=PROMPT, response_ids=c.token_ids, group_id=0, advantages=[1.0 - i % 2 * 2] *
                         len(c.token_ids), **behaviour(c)) for i, c in enumerate(batch.completions)]
        if batch.staleness:
            taken = backend.log_probs(seqs).routed_experts
            for t, c in zip(taken, batch.completions):
                assert np.array_equal(t.array()[: c.routed_experts.tokens], c.routed_experts.array())
            # the newer weights would route some of those tokens elsewhere: what the replay keeps from happening
            native = backend.log_probs([s.model_copy(update={"routed_experts": None}) for s in seqs]).routed_experts
            flips.append(sum(int((n.array()[: c.routed_experts.tokens] != c.routed_experts.array()).any(-1).sum())
                             for n, c in zip(native, batch.completions)))
            stale.append(batch.staleness)
        result = backend.fwd_bwd(seqs, {"name": "grpo", "config": {"use_decoupled_loss": True,
                                                                   "prox_logp_method": "loglinear"}})
        assert np.isfinite(result.loss)
        backend.step()
        pipeline.wait_for_oldest()
        backend.sync_weights()
    pipeline.close()
    backend.close()
    assert stale == [1, 1]  # the second and third batches were sampled a version before the trainer's
    assert sum(flips) > 0, flips


# -- R3 from the vLLM sampler ------------------------------------------------------------------------------------------


@pytest.mark.scenario
def test_r3_on_vllm_records_vllms_own_routing_through_the_prefix_cache_and_a_weight_sync(moe_model):
    from tests.test_vllm_sampler import run_scenario

    result = run_scenario("r3", moe_model)
    # vLLM's layout: every token but the last sampled one, [layers, top_k], the narrowest integer type
    assert result["rows"] == [result["want_rows"]] and result["shape"] == [2, 2] and result["dtype"] == "uint8", result
    # the record is vLLM's routing: the trainer's fp32 forward of the same tokens chooses the same experts, but
    # where rounding flips a near-tie (none on the CPUs seen; 1% would be many times that)
    assert result["choices"] > 4000 and result["disagree"] <= 0.01 * result["choices"], result
    assert result["replayed_routes_are_records"] and result["replayed_lp_err"] <= 2e-5, result
    # a group of 16 read its prompt's blocks from the prefix cache (15 samples x one 128-token block), and each
    # sample's prompt routing is the first one's, and that of an engine without prefix caching
    assert result["cached_rows"] >= 15 * 64 and result["uncached_cached_rows"] == 0, result
    differ, choices = result["prompt_choices_unlike_uncached"]
    assert result["prompt_rows_equal"] and choices == 16 * 150 * 2 and differ <= 0.01 * choices, result
    # a weight sync mid-generation: each span is replayed under the weights that sampled it. The tokens sampled
    # before the sync keep the routing they were sampled with; the continuation computes them again under the new
    # weights routed by that record, so the trainer replaying the record attends to the KV the sampler attended to.
    # Once synced, the sampler's MoE weights are the trainer's.
    assert result["crossed"] == 8 and result["crossed_rows_ok"], result
    assert result["v0_span_err"] <= 2e-5 and result["v1_span_err"] <= 2e-5, result
    assert result["synced_lp_err"] <= 2e-5, result


@pytest.mark.scenario
def test_r3_on_vllm_for_each_moe_family_is_the_trainers_routing(tmp_path):
    from tests.test_vllm_sampler import run_scenario

    result = run_scenario("r3_families", str(tmp_path), timeout=900)
    assert set(result) == {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe"}, result
    for family, row in result.items():
        assert row["rows_ok"] and row["choices"] > 200 and row["disagree"] <= 0.01 * row["choices"], (family, row)


def _recorder(slots=64, block_size=4):
    from arctic_rl_core.samplers.vllm_routed_experts import RoutedExpertsRecorder

    return RoutedExpertsRecorder((2, 2), "uint8", block_size, slots)


def _rows(first, count):
    """Rows whose every id says which token they are (mod 256): [count, 2 layers, 2 experts]."""
    return np.repeat(np.arange(first, first + count, dtype=np.uint8)[:, None, None], 4, 1).reshape(count, 2, 2)


def test_the_recorder_files_each_steps_rows_by_request_and_reads_prefix_cached_ones_from_their_kv_slots():
    from arctic_rl_core.samplers.vllm_routed_experts import rows_of

    recorder = _recorder()
    table = np.array([[3, 7, 0], [3, 9, 0]])  # b shares a's first block (4 tokens), as a prefix-cache hit
    # step 1: a's 6-token prompt; step 2: a decodes one, b (prompt 6, its first 4 cached) prefills 2
    recorder.after_step(_rows(0, 6), ["a"], np.array([6]), np.array([0]), table[:1])
    recorder.after_step(np.concatenate([_rows(6, 1), _rows(104, 2)]), ["a", "b"], np.array([1, 2]),
                        np.array([6, 4]), table)
    taken = {k: rows_of(v, 2, 2, "uint8") for k, v in recorder.take(["a", "b", "never"]).items()}
    assert taken["a"][:, 0, 0].tolist() == list(range(7))
    assert taken["b"][:, 0, 0].tolist() == [0, 1, 2, 3, 104, 105]  # the cached block: a's rows, from its slots
    assert taken["never"].size == 0 and recorder.cached_rows == 4
    # taken before their end was heard: later rows are dropped, and the end forgets them for good
    recorder.after_step(_rows(7, 1), ["a"], np.array([1]), np.array([7]), table[:1], finished=["b"])
    assert "a" not in recorder.records
    recorder.after_step(_rows(0, 0), [], np.array([], dtype=np.int64), np.array([], dtype=np.int64), table,
                        finished=["a", "never"])
    assert not recorder.taken and not recorder.records


def test_a_sample_cut_by_weight_syncs_keeps_each_tokens_row_from_the_request_that_sampled_it():
    from arctic_rl_core.errors import ArcticRLError
    from arctic_rl_core.samplers.vllm_routed_experts import sample_record

    prompt = 4
    # first request sampled 3 tokens (rows 0..5 forwarded), the continuation re-computed rows 0..6 and sampled 2 more
    first, second = _rows(0, 6), _rows(100, 8)
    record = sample_record(prompt, 5, [("r0", 0), ("r1", 3)], {"r0": first, "r1": second})
    assert record[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 106, 107]  # row 6 produced token 3: the continuation's
    # a request cut before it sampled anything: the prompt rows come from the first that computed them
    record = sample_record(prompt, 2, [("r0", 0), ("r1", 0)], {"r0": _rows(0, 0), "r1": _rows(100, 5)})
    assert record[:, 0, 0].tolist() == [100, 101, 102, 103, 104]
    assert sample_record(prompt, 0, [("r0", 0)], {"r0": _rows(0, 3)}) is None
    with pytest.raises(ArcticRLError, match="recorded 3 of the sample's 5 rows"):
        sample_record(prompt, 2, [("r0", 0)], {"r0": _rows(0, 3)})


def test_a_continuation_after_a_weight_sync_is_routed_by_its_samples_record_up_to_the_cut():
    from arctic_rl_core.samplers.vllm_routed_experts import CONTINUES, sample_record

    recorder = _recorder()
    table = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    # "a": 4-token prompt, then 3 decode steps (rows 0..6: the prompt and 3 sampled tokens' inputs); a sync cuts it
    # after 4 sampled tokens, "c" continues it from the prompt + 4 tokens: 8 positions, rows 0..6 forced
    recorder.after_step(_rows(0, 4), ["a"], np.array([4]), np.array([0]), table[:1])
    for position in range(4, 7):
        recorder.after_step(_rows(position, 1), ["a"], np.array([1]), np.array([position]), table[:1])
    recorder.after_step(_rows(0, 0), [], np.array([], dtype=np.int64), np.array([], dtype=np.int64), table,
                        finished=["a"])
    recorder.force("c", {"prompt": 4, "sampled": 4, "spans": [["a", 0]]})
    # a step that prefills 5 of c's 8 positions beside "b" (2 rows), then one that prefills the rest
    index, rows = recorder.forced_step(["b", "c"], np.array([2, 5]), np.array([0, 0]))
    assert index.tolist() == [2, 3, 4, 5, 6] and rows[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    index, rows = recorder.forced_step(["c", "b"], np.array([3, 1]), np.array([5, 2]))
    assert index.tolist() == [0, 1] and rows[:, 0, 0].tolist() == [5, 6]  # position 7 is c's own: it sampled from it
    assert recorder.forced_step(["c"], np.array([1]), np.array([8])) is None  # decoding
    # the record then spliced from both is the forced one, and the continuation ends: forgotten
    recorder.after_step(np.concatenate([_rows(0, 7), _rows(200, 1)]), ["c"], np.array([8]), np.array([0]), table[2:])
    records = {k: v[: v.shape[0]] for k, v in
               ((k, np.frombuffer(b, np.uint8).reshape(-1, 2, 2)) for k, b in recorder.take(["a", "c"]).items())}
    assert sample_record(4, 5, [("a", 0), ("c", 4)], records)[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 200]
    recorder.after_step(_rows(0, 0), [], np.array([], dtype=np.int64), np.array([], dtype=np.int64), table,
                        finished=["c"])
    assert not recorder.forced
    # cut before it sampled anything: the prompt rows the first request computed (all but the last) are forced
    recorder.after_step(_rows(50, 3), ["d"], np.array([3]), np.array([0]), table[:1])
    recorder.force("e", {"prompt": 4, "sampled": 0, "spans": [["d", 0]]})
    assert recorder.forced["e"][:, 0, 0].tolist() == [50, 51, 52]
    recorder.force("f", {"prompt": 4, "sampled": 1, "spans": [["gone", 0]]})  # rows taken: nothing forced
    assert "f" not in recorder.forced and CONTINUES == "arctic_r3_continues"


def _moe_layer(layer: int, router):
    """vLLM's MoE runner of decoder layer `layer` around `router`, as far as routing goes."""
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    module = MoERunner.__new__(MoERunner)
    torch.nn.Module.__init__(module)
    module.layer_name, module.router = f"model.layers.{layer}.mlp.experts", router
    return module


@pytest.mark.parametrize("renormalize", [True, False])
def test_vllms_router_routes_a_continuations_forced_rows_by_its_own_rule(renormalize):
    """Forced rows get the recorded experts, weighted from the live logits as vLLM's CPU router weights its own
    choice; the other rows keep the router's choice untouched."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from arctic_rl_core.samplers.vllm_routed_experts import _route_by_records

    torch.manual_seed(0)
    router = CPURouter(top_k=2, global_num_experts=6, renormalize=renormalize)
    native = CPURouter(top_k=2, global_num_experts=6, renormalize=renormalize)
    rows = torch.tensor([[[0, 1], [5, 4]], [[2, 3], [3, 0]]], dtype=torch.uint8)  # 2 forced rows, [layers, top_k]
    forced = [None]
    _route_by_records("qwen3_moe", torch.nn.Sequential(_moe_layer(1, router)), lambda: forced[0])
    logits = torch.randn(5, 6)
    assert all(torch.equal(a, b) for a, b in zip(router._compute_routing(None, logits, None),
                                                 native._compute_routing(None, logits, None)))
    forced[0] = (torch.tensor([1, 3]), rows)
    weights, ids = router._compute_routing(None, logits, None)
    want_w, want_ids = native._compute_routing(None, logits, None)
    assert ids[[1, 3]].tolist() == [[5, 4], [3, 0]]  # layer 1's rows
    for row, chosen in ((1, [5, 4]), (3, [3, 0])):
        # vLLM's rule on those experts: a softmax over their logits, or their share of the softmax over all
        if renormalize:
            expect = torch.softmax(logits[row, chosen], -1)
        else:
            expect = torch.softmax(logits[row], -1)[chosen]
        torch.testing.assert_close(weights[row], expect, rtol=1e-6, atol=1e-7)
    keep = [0, 2, 4]
    assert torch.equal(ids[keep], want_ids[keep]) and torch.equal(weights[keep], want_w[keep])
    # forced to vLLM's own choice, every row is weighted as vLLM weights it
    own = torch.stack([torch.zeros_like(want_ids), want_ids], 1).to(torch.uint8)
    forced[0] = (torch.arange(5), own)
    weights, ids = router._compute_routing(None, logits, None)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_r3_on_a_router_whose_rule_a_continuation_cannot_follow_is_refused_by_name():
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.samplers.vllm_routed_experts import _route_by_records

    grouped = CPURouter(top_k=2, global_num_experts=8, use_grouped_topk=True, num_expert_group=2, topk_group=1)
    with pytest.raises(InvalidRequest) as err:
        _route_by_records("deepseek_v3", torch.nn.Sequential(_moe_layer(0, grouped)), lambda: None)
    assert err.value.field == "router_replay" and "deepseek_v3" in err.value.message
    assert "CPURouter" in err.value.message and "grouped True" in err.value.message


def test_r3_on_a_family_vllm_serves_without_a_router_hook_is_refused_by_name():
    """vLLM's `bind_routed_experts_capturer` finds no router on a dense module: refused at load, naming the family."""
    from types import SimpleNamespace

    import torch

    from arctic_rl_core.samplers.vllm_routed_experts import RoutedExpertsExtension

    model_config = SimpleNamespace(get_total_num_hidden_layers=lambda: 2, get_num_experts=lambda: 4,
                                   get_num_experts_per_tok=lambda: 2, hf_text_config=SimpleNamespace(model_type="x"))
    config = SimpleNamespace(use_v2_model_runner=False, speculative_config=None, model_config=model_config,
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=8),
                             parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1,
                                                             tensor_parallel_size=1))
    worker = RoutedExpertsExtension()
    worker.model_runner = SimpleNamespace(vllm_config=config, get_model=lambda: torch.nn.Linear(2, 2))
    with pytest.raises(InvalidRequest) as err:
        worker.arctic_record_routed_experts("somefamily_moe")
    assert err.value.field == "router_replay" and "somefamily_moe" in err.value.message
    assert "router hook" in err.value.message
