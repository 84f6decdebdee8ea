"""The training-API contract, run twice: against the in-process backend and through the HTTP server on loopback."""

import math

import pytest
from transformers import AutoTokenizer

from arctic_rl_core.errors import InvalidRequest, UnknownName
from arctic_rl_core.types import LossSpec, SamplingParams, Sequence
from tests.helpers import grpo_batch


def test_grpo_step_changes_state_and_sync_bumps_version(make_api):
    backend = make_api()
    digest = backend.state_digest()
    result = backend.fwd_bwd(grpo_batch(), LossSpec(name="grpo"))
    assert math.isfinite(result.loss) and result.num_sequences == 6
    assert result.num_tokens == sum(len(s.response_ids) for s in grpo_batch())
    assert backend.state_digest() == digest  # gradients are not weights
    stepped = backend.step()
    assert stepped.step == 1 and stepped.grad_norm > 0
    assert backend.state_digest() != digest
    assert backend.weight_version == 0
    assert backend.sync_weights() == 1 and backend.weight_version == 1


def test_sampler_sees_new_weights_only_after_sync(make_api):
    backend = make_api()
    batch = grpo_batch(groups=1, group_size=2)
    completions = backend.generate([batch[0].prompt_ids], SamplingParams(n=2, max_tokens=6, seed=3))
    seqs = [Sequence(prompt_ids=batch[0].prompt_ids, response_ids=c.token_ids) for c in completions]
    trainer = backend.log_probs(seqs).logprobs
    for c, lp in zip(completions, trainer):  # sampler and trainer agree on the same weights
        assert max(abs(a - b) for a, b in zip(c.logprobs, lp)) < 1e-4
    backend.fwd_bwd(batch, "grpo")
    backend.step()
    stale = backend.generate([batch[0].prompt_ids], SamplingParams(n=2, max_tokens=6, seed=3))
    assert [c.token_ids for c in stale] == [c.token_ids for c in completions]
    backend.sync_weights()
    fresh = backend.generate([batch[0].prompt_ids], SamplingParams(n=2, max_tokens=6, seed=3))
    assert fresh[0].weight_version == 1
    assert [c.logprobs for c in fresh] != [c.logprobs for c in completions]

def test_checkpoint_round_trip_gives_bitwise_identical_next_loss(make_api, tmp_path):
    backend = make_api()
    batch = grpo_batch()
    backend.fwd_bwd(batch, "grpo")
    backend.step()
    backend.sync_weights()
    info = backend.save_checkpoint(str(tmp_path / "ckpt"))
    assert (info.step, info.weight_version) == (1, 1)
    digest = backend.state_digest()
    expected = backend.fwd_bwd(batch, "grpo").loss
    backend.step()
    backend.fwd_bwd(batch, "grpo")
    backend.step()
    assert backend.state_digest() != digest
    restored = backend.load_checkpoint(str(tmp_path / "ckpt"))
    assert (restored.step, restored.weight_version) == (1, 1)
    assert backend.state_digest() == digest
    assert backend.fwd_bwd(batch, "grpo").loss == expected  # bitwise
    # A fresh backend restores the same state too.
    other = make_api()
    other.load_checkpoint(str(tmp_path / "ckpt"))
    assert other.state_digest() == digest
    # The weights alone: the same loss, the optimizer's moments gone (its state is a new job's)
    backend.step()  # the gradients of the loss checked above
    weights_only = backend.load_checkpoint(str(tmp_path / "ckpt"), optimizer=False)
    assert (weights_only.step, weights_only.weight_version) == (1, 1)
    assert backend.state_digest() != digest and backend.fwd_bwd(batch, "grpo").loss == expected

def _bad_requests(backend):
    good = grpo_batch()
    yield "loss.name", lambda: backend.fwd_bwd(good, LossSpec(name="no_such_loss"))
    short = good[0].model_copy(update={"advantages": good[0].advantages[:-1]})
    yield "sequences[0].advantages", lambda: backend.fwd_bwd([short] + good[1:], "grpo")
    yield "sequences", lambda: backend.fwd_bwd([], "grpo")
    nan = good[2].model_copy(update={"advantages": [float("nan")] * len(good[2].response_ids)})
    yield "sequences[2].advantages[0]", lambda: backend.fwd_bwd(good[:2] + [nan], "grpo")
    too_long = Sequence(prompt_ids=[5] * 250, response_ids=[6] * 10, advantages=[1.0] * 10)
    yield "sequences[1]", lambda: backend.fwd_bwd([good[0], too_long], "grpo")
    yield "loss.config.eps_clipp", lambda: backend.fwd_bwd(good, LossSpec(name="grpo", config={"eps_clipp": 0.1}))
    no_adv = good[1].model_copy(update={"advantages": None})
    yield "sequences[1].advantages", lambda: backend.fwd_bwd([good[0], no_adv], "grpo")
    yield "sequences[0].ref_logprobs", lambda: backend.fwd_bwd(good, LossSpec(name="grpo", config={"kl_loss_coef": 0.1}))
    weighted = [seq.model_copy(update={"is_weights": [1.0] * len(seq.response_ids),
                                       "behaviour_logprobs": [-1.0] * len(seq.response_ids)}) for seq in good]
    yield "sequences[0].is_weights", lambda: backend.fwd_bwd(weighted, "gmpo")  # gmpo would ignore them
    negative = weighted[1].model_copy(update={"is_weights": [-1.0] * len(good[1].response_ids)})
    yield "sequences[1].is_weights", lambda: backend.fwd_bwd([weighted[0], negative], "grpo")
    out_of_vocab = good[0].model_copy(update={"response_ids": [10**6] * len(good[0].response_ids)})
    yield "sequences[0].response_ids", lambda: backend.fwd_bwd([out_of_vocab], "grpo")
    yield "loss.post[0].name", lambda: backend.fwd_bwd(good, {"name": "grpo", "post": [{"name": "nope"}]})
    yield "sequences[0].response_ids", lambda: backend.fwd_bwd([{"prompt_ids": [1], "response_ids": "abc"}], "grpo")
    yield "step", lambda: backend.step()
    yield "learning_rate", lambda: backend.step(learning_rate=-1.0)
    yield "sampling.max_tokens", lambda: backend.generate([[5, 6]], {"max_tokens": 0})
    yield "prompts[0]", lambda: backend.generate([[5] * 250], SamplingParams(max_tokens=10))
    yield "sampling.stop_token_ids", lambda: backend.generate([[5, 6]], SamplingParams(stop_token_ids=[10**6]))
    yield "path", lambda: backend.load_checkpoint("/nonexistent/checkpoint")

def test_bad_input_names_the_field_and_changes_no_state(make_api):
    backend = make_api()
    # Gradients already accumulated must survive a bad request too.
    backend.fwd_bwd(grpo_batch(seed=1), "grpo")
    backend.step()
    digest = backend.state_digest()
    for field, call in _bad_requests(backend):
        if field == "step":
            continue  # needs a clean gradient state; checked below
        with pytest.raises(InvalidRequest) as err:
            call()
        assert err.value.field == field, str(err.value)
        assert field in str(err.value)
        assert backend.state_digest() == digest, field
    with pytest.raises(InvalidRequest, match="no gradients"):
        backend.step()
    assert backend.state_digest() == digest
    with pytest.raises(UnknownName, match="known: gmpo, grpo, importance_sampling, primerl_default, primerl_ipo, sft"):
        backend.fwd_bwd(grpo_batch(), LossSpec(name="no_such_loss"))
    # Still serving after all of that.
    backend.fwd_bwd(grpo_batch(), "grpo")
    assert backend.step().step == 2

def test_bad_input_does_not_disturb_accumulated_gradients(make_api):
    clean, disturbed = make_api(), make_api()
    batch = grpo_batch()
    for backend in (clean, disturbed):
        backend.fwd_bwd(batch, "grpo")
    with pytest.raises(InvalidRequest):
        disturbed.fwd_bwd(batch[:1] + [batch[1].model_copy(update={"advantages": [float("inf")] * len(batch[1].response_ids)})], "grpo")
    assert clean.step().grad_norm == disturbed.step().grad_norm
    assert clean.state_digest() == disturbed.state_digest()

def test_generate_contract(make_api, tiny_model):
    backend = make_api()
    eos = AutoTokenizer.from_pretrained(tiny_model).eos_token_id
    out = backend.generate([[5, 6, 7], [8, 9]], SamplingParams(n=3, max_tokens=5, seed=7, temperature=0.8, top_k=50))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    for c in out:
        assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
        assert c.weight_version == 0
    again = backend.generate([[5, 6, 7], [8, 9]], SamplingParams(n=3, max_tokens=5, seed=7, temperature=0.8, top_k=50))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]
    # Unseeded calls draw anew: a GRPO group sent as separate requests (prime-rl's orchestrator) is not one sample
    # repeated. Equal draws by chance: about 50^-15 at this temperature and top-k.
    unseeded = [backend.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=5, temperature=0.8, top_k=50))
                for _ in range(2)]
    assert [c.token_ids for c in unseeded[0]] != [c.token_ids for c in unseeded[1]]
    greedy = backend.generate([[5, 6, 7], [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert greedy[0].token_ids == greedy[1].token_ids
    with pytest.raises(InvalidRequest) as err:  # vLLM refuses it: here, before any sampler sees it
        backend.generate([[5, 6, 7]], {"n": 2, "temperature": 0})
    assert err.value.field == "sampling" and "n must be 1" in err.value.message
    # A stop token id ends generation at that token.
    first = greedy[0].token_ids[0]
    stopped = backend.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[first]))
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"
    # min_tokens: no stop token before it (SkyRL sends 1); the log-probs stay the model's own.
    held = backend.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=2, temperature=0, stop_token_ids=[first]))
    assert len(held[0].token_ids) >= 2 and held[0].token_ids[0] != first
    scored = backend.log_probs([Sequence(prompt_ids=[5, 6, 7], response_ids=held[0].token_ids)]).logprobs[0]
    assert max(abs(a - b) for a, b in zip(scored, held[0].logprobs)) < 1e-4
    with pytest.raises(InvalidRequest) as err:
        backend.generate([[5, 6, 7]], {"max_tokens": 2, "min_tokens": 3})
    assert err.value.field == "sampling" and "min_tokens" in err.value.message

def test_sft_loss_through_fwd_bwd_lowers_nll(make_api):
    backend = make_api(learning_rate=1e-2)
    data = [Sequence(prompt_ids=[5, 6, 7], response_ids=[20, 21, 22, 23])]
    first = backend.fwd_bwd(data, "sft").loss
    backend.step()
    for _ in range(5):
        backend.fwd_bwd(data, "sft")
        backend.step()
    assert backend.fwd_bwd(data, "sft").loss < first


def test_the_reference_model_scores_the_initial_weights_while_the_policy_trains(make_api):
    """`source="reference"`: the frozen initial weights, ZoRRo-packed like the trainer's, in process and over HTTP;
    the policy moves away from it, it does not move, and a GRPO KL term trains against it. Its weights are parked
    in host memory between calls (`offload`), which on this CPU machine is where they are anyway."""
    backend = make_api(reference={"enable": True, "offload": True}, learning_rate=1e-2)
    seqs = grpo_batch()
    initial = backend.log_probs(seqs, with_entropy=True, temperature=0.7)
    reference = backend.log_probs(seqs, with_entropy=True, temperature=0.7, source="reference")
    for got, want in ((reference.logprobs, initial.logprobs), (reference.entropy, initial.entropy)):
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5
    ref = [s.model_copy(update={"ref_logprobs": lp}) for s, lp in zip(seqs, backend.log_probs(seqs, source="reference").logprobs)]
    for _ in range(2):
        result = backend.fwd_bwd(ref, {"name": "grpo", "config": {"kl_loss_coef": 0.1}})
        backend.step()
    assert result.metrics["kl"] > 0  # the policy moved away from the reference ...
    moved = backend.log_probs(seqs).logprobs
    again = backend.log_probs(seqs, source="reference").logprobs
    assert max(abs(a - b) for x, y in zip(moved, initial.logprobs) for a, b in zip(x, y)) > 1e-4
    assert again == backend.log_probs(seqs, source="reference").logprobs  # ... which did not move
    assert max(abs(a - b) for x, y in zip(again, [s.ref_logprobs for s in ref]) for a, b in zip(x, y)) < 1e-6
    described = backend.describe() if hasattr(backend, "describe") else backend.status()["backend"]
    assert described["reference"]["zorro"] is True and described["reference"]["offload"] is True  # status names it


def test_log_probs_of_a_reference_the_job_does_not_have_are_refused(make_api):
    with pytest.raises(InvalidRequest) as err:
        make_api().log_probs(grpo_batch(), source="reference")
    assert err.value.field == "source" and "reference.enable" in err.value.message


def test_fwd_bwd_returns_the_log_probs_and_entropy_of_its_own_forward(make_api):
    backend = make_api()
    seqs = grpo_batch()
    expected = backend.log_probs(seqs, with_entropy=True, temperature=0.7)
    hot = {"name": "grpo", "post": [{"name": "apply_temperature", "config": {"temperature": 0.7}}]}
    out = backend.fwd_bwd(seqs, hot, return_logprobs=True, with_entropy=True)
    for got, want in ((out.logprobs, expected.logprobs), (out.entropy, expected.entropy)):
        assert [len(x) for x in got] == [len(x) for x in want]
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5
    plain = backend.fwd_bwd(seqs, "grpo")
    assert plain.logprobs is None and plain.entropy is None
    with pytest.raises(InvalidRequest) as err:
        backend.fwd_bwd(seqs, "grpo", with_entropy=True)
    assert err.value.field == "with_entropy"
