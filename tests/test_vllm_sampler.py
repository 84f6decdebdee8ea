"""The vLLM sampler: weights really arrive on every sync path, generate runs during training, bad input.

Each scenario runs in a process of its own (one backend per process, as deployed), forked from an interpreter that
has imported the libraries already (tests/preimported.py).
"""

import json

import pytest

from arctic_rl_core.engines.distributed import standalone_env
from tests import preimported


def run_scenario(*args, timeout=300):
    proc = preimported.run("tests.vllm_scenarios", *args, env=standalone_env(), timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


# The default route runs in `make test`; the others, each a vLLM process or two, in `make scenarios`.
_SCENARIO = pytest.mark.scenario


@pytest.mark.parametrize("sync, placement, layout, route", [
    # the trainer writes straight into vLLM's tensors; the packed layout's oneDNN packs are rebuilt from them
    ("shared_memory", "in_process", "packed", "direct"),
    pytest.param("shared_memory", "in_process", "plain", "direct", marks=_SCENARIO),  # F.linear reads them as written
    pytest.param("shared_memory", "subprocess", "packed", "direct", marks=_SCENARIO),  # ... in a shared-memory file
    pytest.param("shared_memory", "subprocess", "plain", "direct", marks=_SCENARIO),
    pytest.param("broadcast", "subprocess", "packed", "buckets", marks=_SCENARIO),  # loaded in place, then repacked
    pytest.param("broadcast", "subprocess", "plain", "buckets", marks=_SCENARIO),  # loaded in place by vLLM's load_weights
    pytest.param("file", "in_process", "packed", "file", marks=_SCENARIO),
    pytest.param("file", "subprocess", "packed", "file", marks=_SCENARIO),
])
def test_weights_arrive_on_every_sync_path(tiny_model, sync, placement, layout, route):
    result = run_scenario("sync", tiny_model, sync, placement, layout)
    assert result["sync_route"] == route
    assert result["initial_err"] <= 1e-3  # same weights at start
    assert result["stale_err"] > 1e-2  # after a step, before the sync, they differ
    assert result["synced_err"] <= 1e-3  # after the sync the sampler computes what the trainer does
    assert result["second_synced_err"] <= 1e-3
    assert result["weight_mb"] > 0.3  # several 0.1 MB buckets
    assert result["version"] == 2 and result["completion_versions"] == [2]
    assert result["behaviour_err"] <= 1e-3  # sampled log-probs are usable as behaviour log-probs
    # The worker's generators are put back as they were; in this process vLLM forms a call's batch at once, so the
    # same draws land on the same samples (an engine core of its own forms it as the requests arrive).
    assert result["draws_move_on"] and result["state_put_back"]
    assert result["drawn_again"] or placement == "subprocess"
    assert result["shared_memory_files"] == []  # each is unlinked once both sides have it mapped
    # vLLM's engine core, where it is a process of its own (its one worker inside it), stops with the sampler
    assert len(result["engine_processes"]) == (1 if placement == "subprocess" else 0), result["engine_processes"]
    assert result["processes_after_close"] == []
    assert result["shared_memory_files_after_close"] == []
    # vLLM's shutdown thaws the heap its engine froze, and the loader earlier (vllm_plain_weights)
    assert result["frozen_after_close"] == 0
    if placement == "in_process":
        # plain: multiplied with F.linear on the tensors that syncs overwrite; packed: vLLM's oneDNN kernels on
        # packs of those tensors (the synced log-probs above show the packs were rebuilt)
        assert result["plain_linear"] == (layout == "plain")
        assert result["written_in_place"]
        # every change to vLLM's objects and environment is a recorded patch
        patches = result["patches"]
        assert patches["os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']"] == 0  # scoped to the engine's start
        assert "linear layers keep their checkpoint-layout weights (_cpu_skip_gemm_dispatch)" in patches
        packs = "linear layers and LM head multiply with oneDNN packs built from their kept weights (cpu_linear)"
        assert (packs in patches) == (layout == "packed")
        # vLLM's sampler counts the ranks of what it returns log-probs for without compiling a kernel
        assert patches["vllm.v1.sample.sampler.batched_count_greater_than"] == 1


def test_an_engine_that_fails_to_start_leaves_no_heap_frozen(tmp_path):
    """Our CPU loaders freeze the heap as they load (vLLM's shutdown thaws it); an engine refused after loading, here
    for a KV cache that holds no whole sequence, is never shut down: the heap is thawed all the same."""
    from arctic_rl_core.models.tiny import make_tiny_model

    model = make_tiny_model("qwen3", str(tmp_path / "model"), layers=8, hidden=256, heads=8, kv_heads=8)
    result = run_scenario("failed_start", model)
    assert "KV cache" in result["error"], result
    assert result["frozen"] == 0


def test_the_eager_rank_count_is_vllms_own_expression():
    """`vllm_eager_ranks`: the count vLLM's sampler compiles, as its own Python function computes it (ties and
    -inf included), for one row and for many."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from arctic_rl_core.samplers.vllm_eager_ranks import count_at_least

    vllms = batched_count_greater_than._torchdynamo_orig_callable
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        logprobs = torch.randn(rows, 64, generator=generator).log_softmax(-1).round(decimals=1)
        logprobs[:, 3] = float("-inf")
        picked = logprobs.gather(-1, torch.randint(0, 64, (rows, 1), generator=generator))
        picked[0, 0] = float("-inf")  # a token the sampler's masks ruled out: every position counts
        assert torch.equal(count_at_least(logprobs, picked), vllms(logprobs, picked))
        assert count_at_least(logprobs, picked)[0] == 64


@pytest.mark.scenario
@pytest.mark.parametrize("placement", ["in_process", "subprocess"])
def test_full_weights_saved_to_disk_load_back_into_the_sampler(tiny_model, placement):
    """Tinker's sampler snapshots on vLLM: the base model's and a trained model's weights, written to disk, load
    back after other weights and sample and score as they did (greedy tokens equal, log-probs within 1e-5)."""
    result = run_scenario("snapshots", tiny_model, placement)
    assert result["tokens_differ"]
    assert result["base_tokens"] and result["trained_tokens"]
    assert result["base_err"] <= 1e-5 and result["trained_err"] <= 1e-5
    assert result["versions"] == [2, 3] and result["sampled_versions"] == [2, 3]


@pytest.mark.scenario
def test_generate_does_not_wait_for_a_running_fwd_bwd(tiny_model):
    result = run_scenario("concurrent", tiny_model)
    assert result["generated"] == 4 and result["training_alive"] and result["training_done"]


def test_bad_generate_input_names_the_field_and_engine_keeps_serving(tiny_model):
    result = run_scenario("bad_input", tiny_model)
    assert result["fields"] == {"too_long": "prompts[0]", "max_tokens": "sampling.max_tokens",
                                "negative_max_tokens": "sampling.max_tokens", "stop_token": "sampling.stop_token_ids",
                                "sampler_temperature": "temperature", "greedy_n": "sampling"}
    assert result["still_serving"]
    greedy, cut = result["greedy"], result["cut"]
    assert result["free_finish"] == "length" and len(greedy) == 8
    assert result["finish"] == ["stop", "stop"]
    for tokens in result["stopped"]:  # vLLM keeps the stop token itself in the ids
        assert tokens == greedy[: cut + 1], (tokens, greedy, cut)
    assert result["seeded_batch"] == [96, True]


@pytest.mark.scenario
@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_trainer_and_sampler_agree_for_softcapped_and_scaled_logit_families(tiny_models, family):
    """Gemma 2 (attention and final softcaps, a window of 8 under 15-token sequences) and Granite (scaled
    logits): the trainer's log-probs are vLLM's, before training and after a step and a sync."""
    result = run_scenario("sync", tiny_models[family], "shared_memory", "in_process", "packed")
    assert result["initial_err"] <= 1e-3
    assert result["stale_err"] > 1e-2
    assert result["synced_err"] <= 1e-3 and result["second_synced_err"] <= 1e-3
    assert result["behaviour_err"] <= 1e-3


@pytest.mark.scenario
def test_serving_routes_report_the_vllm_samplers_own_log_probs(tiny_model):
    result = run_scenario("serving", tiny_model)
    assert result["sampled_err"] < 1e-3 and result["prompt_err"] < 1e-3
    assert result["top_sizes"] in ([3], [3, 4], [4]) and result["top_ordered"]
    assert result["prompt_ranks"] in ([2], [2, 3], [3])
    assert result["captured"]
    # temperature 0.7, top_p 0.95 with nothing of ours: the sampled distribution's log-probs, reported and captured
    assert result["agent_reported_is_captured"], result
    # (positions where a token's rank sits on the nucleus' edge, within rounding, are not compared)
    assert result["agent_err"] <= 1e-4 and result["agent_compared"] >= result["agent_positions"] // 2, result
    assert result["agent_step"] == [True, True], result  # a GRPO step on the captured episode trains


@pytest.mark.scenario
def test_served_requests_join_the_running_batch_and_an_abort_returns_their_partial_samples(tiny_model):
    result = run_scenario("serving_batch", tiny_model)
    assert result["running_after_shorts"] == 4 and result["short_tokens"] == [4] * 4, result
    assert result["aborted_finish"] == ["abort"], result
    assert all(0 < n < result["long_tokens"] for n in result["aborted_tokens"]), result
    assert result["aborted_err"] <= 1e-3, result
    assert result["after"] == "length"
    assert result["generate_calls"] == result["requests"] == 10  # one call each: nothing gathered them
    # /metrics (vLLM's names): it saw the 4 long requests running; now nothing runs or waits, every sampled token
    # is counted, and the KV cache's size is there to read (64 MiB of the tiny model's blocks).
    assert result["metrics_after"] == [0, 0], result
    generation_tokens, sampled = result["metrics_generation_tokens"]
    assert generation_tokens >= sampled > 0, result
    assert result["metrics_kv_tokens"] > 1000, result


@pytest.mark.scenario
@pytest.mark.parametrize("placement", ["in_process", "subprocess"])  # the engine core in its own process runs ahead
def test_a_weight_sync_mid_generation_loses_no_request_and_each_span_is_its_versions_model(tiny_model, placement):
    result = run_scenario("crossing", tiny_model, placement)
    assert result["version"] == 1 and result["completions"] == 16 and result["lengths"] == [160], result
    assert result["finish"] == ["length"]  # none lost, none cut short
    assert result["versions"] == [[0, 1]] and result["ordered"], result  # every one crossed the sync, in order
    assert 0 < min(result["first_span"]) and max(result["first_span"]) < 160, result
    # each span's sampled log-probs are the trainer's at the version that sampled it ...
    assert result["v0_span_err"] <= 1e-3 and result["v1_span_err"] <= 1e-3, result
    assert result["v0_span_vs_v1_trainer"] > 1e-2, result  # ... and the two versions differ
    # pause_generation (vLLM's `keep`): frozen while paused, the rest sampled under the weights synced meanwhile
    assert result["paused"] and result["frozen"][0] == result["frozen"][1] > 0, result
    kept = result["kept_version"]
    assert result["kept_versions"] == [[kept - 1, kept]] and result["kept_lengths"] == [160], result
    assert result["engine_idle"]


@pytest.mark.scenario
def test_streamed_replies_arrive_as_the_engine_samples_them(tiny_model):
    result = run_scenario("streaming", tiny_model)
    # a piece per engine step (one token each here), the first while the engine was still sampling the request
    assert result["pieces"] == result["tokens"] == 120 and result["sampling_at_first_piece"], result
    assert result["text_is_reply"] and result["finish"] == ["length"] and result["usage"] == [120], result
    # a stop string: the content is the reply cut before it, and no piece ever held any of it
    assert result["chat_pieces"] > 2 and result["chat_content_is_cut_reply"] and not result["stop_sent"], result
    assert result["chat_finish"] == [["stop", True]], result
    # with log-probs too: a piece per step, the first while sampling, their entries the captured behaviour log-probs
    assert result["logprob_pieces"] == 60 and result["logprobs_while_sampling"], result
    assert result["streamed_logprobs_are_captured"] and result["streamed_tops"] == [2], result
    assert result["completion_offsets"] == [40, True], result
    assert result["echo"] == ["Once upon", 22], result  # the prompt, 20 pieces, the last chunk (its finish reason)
    assert result["token_stream"] == {"pieces": 30, "while_sampling": True, "ids": True, "entries": True,
                                      "ranked": True, "last": ["length", True]}, result


@pytest.mark.scenario
@pytest.mark.parametrize("placement", ["in_process", "subprocess"])
def test_a_client_that_goes_away_stops_its_request_and_the_episode_keeps_what_it_received(tiny_model, placement):
    result = run_scenario("cancelled", tiny_model, placement)
    # A stream closed after 3 pieces: the engine stopped within some steps (a token each), not at 1,500 tokens (4 in
    # all here; the bound leaves a loaded machine's delay in noticing the close).
    assert result["stream_received"] == 3 and result["stream_sampled"] - 3 < 100, result
    # what the server sent the client: what it read, and at most the pieces still on their way when it closed
    assert result["stream_turn"] == [True, True, "abort", True], result
    assert result["stream_received"] <= result["stream_recorded"] <= result["stream_sampled"], result
    # A client that timed out after 1 s: its request stopped too, and the turn it never received holds no token.
    assert result["timed_out"] and 0 < result["timeout_sampled"] < 1500, result
    assert result["timeout_turn"] == [True, []], result
    assert result["bystander"] == ["length", 300] and result["engine_idle"], result
    assert result["cancelled"] == 2, result
    assert result["gauge_idle_s"] < 5, result  # /metrics: nothing running once the engine stopped (not the last step's)


@pytest.mark.scenario
def test_constrained_replies_follow_their_grammar_and_report_the_masked_distribution(tiny_model):
    result = run_scenario("constrained", tiny_model)
    allowed = {"get_weather": ("city", {"Paris", "Rome"}), "get_time": ("zone", {"UTC", "CET"})}

    def valid(calls):  # each call names a tool and its arguments are what that tool's schema allows
        return all(name in allowed and list(args) == [allowed[name][0]] and args[allowed[name][0]] in allowed[name][1]
                   for name, args in calls)

    finish, content, calls = result["required"]
    assert finish == "tool_calls" and content == "" and calls and valid(calls), result
    finish, content, calls = result["named"]  # a named function's call ends as "stop", as on vLLM
    assert finish == "stop" and content == "" and [c[0] for c in calls] == ["get_time"] and valid(calls), result
    finish, content, calls = result["one_call"]  # parallel_tool_calls false: one call
    assert finish == "tool_calls" and len(calls) == 1 and valid(calls), result
    finish, reply = result["json_schema"]
    assert finish == "stop" and valid([["get_weather", reply]]), result
    # Sampled under `choice`: nothing but the choices; the reported log-probs are the masked distribution's (above
    # the model's own: the mask removed mass) and the session holds them; `logprobs_of: model` gives the trainer's.
    assert result["choice_texts"] == [] and result["choice_finish"] == ["stop"] and result["choice_captured"], result
    assert result["choice_min_gap"] >= -1e-4 and result["choice_max_gap"] > 0.1, result
    assert result["model_err"] < 1e-4, result
    assert result["refused"] == {
        "bad_regex": [400, "structured_outputs"], "bad_schema": [400, "structured_outputs"],
        "two": [400, "structured_outputs"], "unknown_tool": [400, "tool_choice.function.name"],
        "no_tools": [400, "tool_choice"], "tools_and_format": [400, "tool_choice"],
        "bias_outside": [400, "logit_bias"]}, result
    # vLLM's logits processors: a +100 bias samples its token; allowed tokens only those, their log-probs the
    # model's renormalised over them; a banned word is not sampled even under that bias
    assert result["biased"] == [77] * 5 and not result["banned"], result
    tokens, err = result["allowed"]
    assert set(tokens) <= {30, 31, 32} and err < 1e-4, result
    assert result["still_serving"], result


@pytest.mark.scenario
def test_abort_generation_returns_what_each_request_sampled_and_the_engine_serves_on(tiny_model):
    result = run_scenario("abort", tiny_model)
    assert result["completions"] == 64 and result["finish"] == ["abort"], result  # 240 forced tokens: none ended
    assert result["returned_after_abort_s"] < result["small_s"], result  # an engine step, not the rest of the call
    # Every sample was running: each returns its partial tokens, with the model's own log-probs.
    assert result["aborted"] == result["partial"] == 64 and result["logprobs_per_token"], result
    assert 0 < result["shortest_partial"] and result["longest_partial"] < 240, result
    assert result["partial_err"] <= 1e-3, result
    assert result["after"][0] in ("stop", "length") and result["engine_idle"]


def test_concurrent_calls_join_one_running_batch(tiny_model):
    """vLLM's engine is driven by one loop for every caller: short calls sent while a long one decodes return while
    it still runs, not after it."""
    result = run_scenario("continuous", tiny_model)
    assert result["long_running_after_shorts"], result
    assert max(result["short_s"]) < result["long_s"] / 2, result
    assert result["lengths"] == [8, 200] and result["completions"] == 20
    assert result["sampled_err"] <= 1e-3, result
    assert result["calls"] == 7  # each caller's own call: nothing gathered them


@pytest.mark.scenario
def test_reshaped_sampling_reports_the_models_own_log_probs_or_the_sampled_distributions(tiny_model):
    result = run_scenario("reshaped", tiny_model)
    for name in ("top_p", "top_k", "min_p", "penalties", "plain", "min_tokens"):  # logprobs_of: model, at 1
        assert result[name] < 1e-3, (name, result)
    assert result["min_tokens_shortest"] >= 6, result
    # logprobs_of: sampler at 0.7: penalties as vLLM applies them, which change the distribution
    assert result["sampler_penalties"] < 1e-4 and result["penalties_matter"] > 5e-3, result
    assert result["min_p_kept"] and result["min_p_err"] < 1e-3, result
    assert result["min_p_compared"] >= result["min_p_positions"] / 2, result
    assert (result["hot_top_p"], result["hot_min_tokens"], result["hot_presence"]) == (
        "sampling.top_p", "sampling.min_tokens", "sampling.presence_penalty")
    assert result["hot_plain"] == 2


@pytest.mark.scenario
@pytest.mark.parametrize("placement, family", [("in_process", "qwen3"), ("subprocess", "qwen3_moe")])
def test_zorro_inference_decodes_shared_prompts_with_forest_cascade_attention(tiny_models, tmp_path, placement,
                                                                               family):
    """zorro.inference inside vLLM (here its CPU engine, the kernels under Triton's interpreter): the decoding steps
    of 2 prompts x 4 samples read each prompt's shared blocks once, and the samples' log-probs are the trainer's.
    In a vLLM process of its own it is registered by our vllm.general_plugins entry point. There, on a
    mixture-of-experts model with R3, the cascade records: each sample's routing is vLLM's, replayed by the trainer."""
    if family in tiny_models:
        model = tiny_models[family]
    else:
        from arctic_rl_core.models.tiny import make_tiny_model

        model = make_tiny_model(family, str(tmp_path / family), max_positions=256)
    replay = "R3" if family.endswith("_moe") else "off"
    result = run_scenario("cascade", model, placement, replay)
    assert result["lengths"] == [8] and result["distinct"] > 1
    assert result["sampled_err"] <= 1e-4
    if replay == "R3":  # every token but the last sampled one; near-ties aside (none seen), the trainer's choice
        assert result["rows_ok"] and result["choices"] > 500 and result["disagree"] <= 0.01 * result["choices"], result
    # 8 tokens: the first from the prefill, 7 decoding steps, each in both attention layers. Where vLLM prefilled
    # the second prompt a step after the first (its engine core takes requests as they arrive), that step mixes a
    # prefill in and runs vLLM's own kernels.
    served_groups = result["served_groups"]
    assert served_groups["cascade"] + served_groups.get("plain", 0) == 7 and served_groups["cascade"] >= 6
    assert served_groups["cascade_layers"] == 2 * served_groups["cascade"]
    # After a step and a sync the engine still decodes with it, with the new weights (how many of the 2 samples'
    # steps share depends on whether vLLM prefilled them in one step); then unrelated prompts, sharing nothing,
    # decode with vLLM's own kernels (3 steps).
    served = result["served"]
    assert result["synced_err"] <= 1e-4
    assert served["cascade"] > served_groups["cascade"] and served["cascade_layers"] == 2 * served["cascade"]
    assert served["plain"] >= 3 and served["cascade"] + served["plain"] == 7 + 2 + 3
    if placement == "in_process":  # vLLM's registry is restored once the engine's layers hold their backend
        patches = result["patches"]
        assert patches["vLLM's attention backend overrides[<AttentionBackendEnum.CUSTOM: None>]"] == 0
        assert patches["vllm.triton_utils.triton"] == 0



@pytest.mark.scenario
def test_a_lora_jobs_vllm_sampler_serves_saved_adapters_each_as_its_trainer_scores_it(tiny_model):
    """vLLM's multi-LoRA on the base model (sampler.adapters): two adapters saved at different training states sample
    in one running batch, each within 1e-4 of the trainer holding that state; what vLLM cannot score under an
    adapter, and adapters once the sampler holds synced weights, are refused by name."""
    result = run_scenario("adapters", tiny_model)
    assert result["t1_err"] <= 1e-4 and result["t2_err"] <= 1e-4, result
    assert result["base_vs_t2"] > 1e-2, result  # without the adapter the samples are the base model's
    assert result["version_before_sync"] == 0
    assert result["refused"] == ["sampling.adapter", "sampling.prompt_logprobs", "sampling.top_k"]
    assert result["t2_after_refusals_err"] <= 1e-4  # refused before the engine: it samples on
    assert result["synced_err"] <= 1e-4 and result["after_sync_refused"] == "sampling.adapter"
