"""The in-process training API on the real DeepSpeed engine and a tiny model."""

import math
import os
import shutil

import pytest
import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import LossSpec, SamplingParams, Sequence
from tests.helpers import grpo_batch, sampled_distribution_logprobs


def weights(backend):
    return {name: t.clone() for name, t in backend.engine.named_full_weights()}  # tensors are lent, not given


def test_grpo_step_changes_weights_and_sync_bumps_version(make_backend):
    backend = make_backend()
    before = weights(backend)
    result = backend.fwd_bwd(grpo_batch(), LossSpec(name="grpo"))
    assert math.isfinite(result.loss) and result.num_sequences == 6
    assert result.num_tokens == sum(len(s.response_ids) for s in grpo_batch())
    stepped = backend.step()
    assert stepped.step == 1 and stepped.grad_norm > 0
    after = weights(backend)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before)
    assert backend.weight_version == 0
    assert backend.sync_weights() == 1 and backend.weight_version == 1
    sampler = dict(backend.sampler.model.named_parameters())
    assert all(torch.equal(sampler[n], after[n]) for n in after)


def test_deepspeeds_backend_is_up_without_compiling_its_shared_memory_all_reduce(make_backend):
    """On CPU DeepSpeed would compile a C++ extension at its first init_distributed (minutes on a small machine)
    for an all-reduce only its inference path uses: the engine starts without it, as a recorded patch."""
    import deepspeed.comm.comm as ds_comm

    from arctic_rl_core.patches import applied

    make_backend()
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    if not torch.cuda.is_available():
        [row] = [r for r in applied() if r["patch"] == "deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']"]
        assert row["by"] == "arctic_rl_core.engines.distributed"


SGD = {"optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}  # updates proportional to the gradient


def test_a_step_at_learning_rate_zero_moves_no_weight_but_counts(make_backend):
    """A warm-up schedule's first step: the optimizer's state advances, the weights do not."""
    backend = make_backend()
    before = weights(backend)
    backend.fwd_bwd(grpo_batch(), "grpo")
    result = backend.step(learning_rate=0.0)
    assert result.step == 1 and result.learning_rate == 0.0 and backend.describe()["learning_rate"] == 0.0
    assert all(torch.equal(before[n], w) for n, w in weights(backend).items())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_steps_adam_settings_train_as_an_optimizer_built_with_them_and_carry_over_to_no_other_step(make_backend,
                                                                                                  stage):
    """Tinker's AdamParams come with every step: betas, eps, weight decay and clipping given to a step train as
    torch's AdamW built with them (the job's optimizer is that AdamW); the next step without them is the job's."""
    from arctic_rl_core.types import AdamSettings

    given = dict(betas=(0.5, 0.8), eps=1e-3, weight_decay=0.3, grad_clip=0.05)
    built = make_backend(zero_stage=stage, betas=list(given["betas"]), eps=given["eps"],
                         weight_decay=given["weight_decay"], grad_clip=given["grad_clip"])
    per_call = make_backend(zero_stage=stage)  # the job's: betas 0.9/0.999, eps 1e-8, no decay, clip 1.0
    job = make_backend(zero_stage=stage)
    for backend, adam in ((built, None), (per_call, AdamSettings(**given)), (job, None)):
        backend.fwd_bwd(grpo_batch(), "grpo")
        backend.step(learning_rate=1e-2, adam=adam)
    assert all(torch.allclose(built_w, w, rtol=1e-6, atol=1e-9)
               for built_w, w in zip(weights(built).values(), weights(per_call).values()))
    assert not all(torch.allclose(job_w, w, rtol=1e-6, atol=1e-9)
                   for job_w, w in zip(weights(job).values(), weights(per_call).values()))
    # The next step without them is the job's.
    per_call.fwd_bwd(grpo_batch(), "grpo")
    per_call.step(learning_rate=1e-2)
    groups = per_call.engine.engine.optimizer.param_groups
    assert all(g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8 and g["weight_decay"] == 0.0 for g in groups)
    assert per_call.engine.engine.gradient_clipping() == 1.0


@pytest.mark.parametrize("field, value", [("betas", (0.9, 1.0)), ("betas", (-0.1, 0.9)), ("eps", -1e-8),
                                          ("eps", float("nan")), ("weight_decay", -0.1),
                                          ("weight_decay", float("inf")), ("grad_clip", -1.0)])
def test_bad_adam_settings_are_refused_by_field_and_change_nothing(make_backend, field, value):
    backend = make_backend()
    backend.fwd_bwd(grpo_batch(), "grpo")
    digest = backend.state_digest()
    with pytest.raises(InvalidRequest, match=rf"adam\.{field}"):
        backend.step(learning_rate=1e-2, adam={field: value})
    assert backend.state_digest() == digest and backend.engine.has_gradients  # the step can still be taken
    assert backend.step(learning_rate=1e-2).step == 1


def update(backend, before):
    after = weights(backend)
    return torch.cat([(after[n] - before[n]).flatten() for n in before])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("zorro", [False, True])
def test_accumulation_over_micro_batches_matches_one_batch(make_backend, stage, zorro):
    batch = grpo_batch(groups=3, group_size=3)
    one = make_backend(zero_stage=stage, ds_config=SGD, zorro=zorro)
    start = weights(one)
    one.fwd_bwd(batch, "grpo")
    norm_one = one.step().grad_norm
    # One sequence per micro-batch: the loss uses batch-wide denominators, so gradients are the same.
    split = make_backend(zero_stage=stage, micro_batch_tokens=16, ds_config=SGD, zorro=zorro)
    split.fwd_bwd(batch, "grpo")
    norm_split = split.step().grad_norm
    assert norm_split == pytest.approx(norm_one, rel=1e-5)
    u1, u2 = update(one, start), update(split, start)
    assert (u1 - u2).norm() <= 1e-5 * u1.norm()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_add_up_over_fwd_bwd_calls(make_backend, stage):
    batch = grpo_batch(groups=2, group_size=2, response_len=4)
    # seq-mean-token-sum over 2 halves of equal sequence count: each half's loss is half the whole.
    whole = make_backend(zero_stage=stage)
    whole.fwd_bwd(batch, LossSpec(name="grpo", config={"loss_agg_mode": "seq-mean-token-sum"}))
    norm_whole = whole.step().grad_norm
    halves = make_backend(zero_stage=stage)
    for part in (batch[:2], batch[2:]):
        halves.fwd_bwd(part, LossSpec(name="grpo", config={"loss_agg_mode": "seq-mean-token-sum"}))
    norm_halves = halves.step().grad_norm
    assert norm_halves == pytest.approx(2 * norm_whole, rel=1e-5)


def test_a_zero3_engine_leaves_other_models_of_the_process_whole(make_backend):
    """ZeRO-3 partitions the trainer's model as it loads; the sampler's model, loaded next in the same process,
    and the models of backends made later must stay whole (transformers' ZeRO-3 setting is process-wide)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    backend = make_backend(zero_stage=3)
    assert not is_deepspeed_zero3_enabled()
    assert all(p.numel() > 0 for p in backend.sampler.model.parameters())
    [completion] = backend.generate([[5, 6, 7]], {"max_tokens": 4, "temperature": 0.0})
    assert len(completion.token_ids) >= 1
    batch = grpo_batch(groups=1, group_size=2)
    backend.fwd_bwd(batch, "grpo")
    backend.step()
    assert backend.sync_weights() == 1


def test_zero3_jobs_started_one_after_another_do_not_pile_up_deepspeeds_buffers(make_backend):
    """ZeRO-3's hooks keep DeepSpeed's engine reachable after its job is gone, with a gradient bucket of 2 GB
    (DeepSpeed's default, mostly never touched). A process that starts jobs one after another, closed or merely
    dropped, keeps none of them: before this, each took that much more of the address space, until a test worker
    forking a process was refused (ENOMEM) once one mapping passed the machine's memory."""
    import gc

    def address_space_mb() -> int:
        return int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) >> 10

    make_backend(zero_stage=3).close()  # the first pays for what stays: imports, thread pools
    gc.collect()
    before = address_space_mb()
    for close in (True, False, True):
        backend = make_backend(zero_stage=3)
        backend.fwd_bwd(grpo_batch(groups=1, group_size=2), "grpo")  # the bucket fills
        backend.step()
        if close:
            backend.close()
        del backend
        gc.collect()
    assert address_space_mb() - before < 1024, (before, address_space_mb())


def test_log_probs_with_entropy_and_temperature(make_backend):
    backend = make_backend()
    batch = grpo_batch(groups=1, group_size=2)
    plain = backend.log_probs(batch, with_entropy=True)
    assert [len(x) for x in plain.logprobs] == [len(s.response_ids) for s in batch]
    assert all(0 <= e <= math.log(backend.engine.vocab_size) + 1e-4 for row in plain.entropy for e in row)
    hot = backend.log_probs(batch, temperature=2.0)
    assert hot.logprobs != plain.logprobs and hot.entropy is None
    # The first response token is predicted from the last prompt position: check against a full forward.
    model = backend.sampler.model
    seq = batch[0]
    ids = torch.tensor([seq.prompt_ids + seq.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float().log_softmax(-1)
    p = len(seq.prompt_ids)
    expected = [logits[p - 1 + i, t].item() for i, t in enumerate(seq.response_ids)]
    assert max(abs(a - b) for a, b in zip(expected, plain.logprobs[0])) < 1e-5


def test_lora_trains_adapters_and_sync_merges_them(make_backend):
    backend = make_backend(lora={"r": 4, "alpha": 8}, learning_rate=1e-2)
    base_before = weights(backend)
    trainable = [n for n, p in backend.engine.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    batch = grpo_batch()
    backend.fwd_bwd(batch, "grpo")
    backend.step()
    backend.fwd_bwd(batch, "grpo")  # lora_B starts at zero: a second step makes the merged delta non-zero
    backend.step()
    merged = weights(backend)
    assert set(merged) == set(base_before)
    assert any(not torch.equal(merged[n], base_before[n]) for n in merged)
    backend.sync_weights()
    trainer = backend.log_probs(batch).logprobs
    seqs = [Sequence(prompt_ids=s.prompt_ids, response_ids=s.response_ids) for s in batch]
    model = backend.sampler.model
    for seq, lp in zip(seqs, trainer):
        ids = torch.tensor([seq.prompt_ids + seq.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].log_softmax(-1)
        p = len(seq.prompt_ids)
        expected = [logits[p - 1 + i, t].item() for i, t in enumerate(seq.response_ids)]
        assert max(abs(a - b) for a, b in zip(expected, lp)) < 1e-4


def test_zorro_on_and_off_give_the_same_training_step(make_backend):
    """Through the DeepSpeed engine: same loss, log-probs, gradient norm and update with and without sharing."""
    batch = grpo_batch(groups=3, group_size=4, prompt_len=20)
    on = make_backend(zorro=True, ds_config=SGD)
    off = make_backend(zorro=False, ds_config=SGD)
    start = weights(on)
    lp_on, lp_off = on.log_probs(batch).logprobs, off.log_probs(batch).logprobs
    assert max(abs(a - b) for x, y in zip(lp_on, lp_off) for a, b in zip(x, y)) < 1e-5
    r_on, r_off = on.fwd_bwd(batch, "grpo"), off.fwd_bwd(batch, "grpo")
    assert r_on.loss == pytest.approx(r_off.loss, rel=1e-5, abs=1e-8)
    assert on.step().grad_norm == pytest.approx(off.step().grad_norm, rel=1e-5)
    u_on, u_off = update(on, start), update(off, start)
    assert (u_on - u_off).norm() <= 1e-5 * u_off.norm()


def test_penalised_sampling_reports_the_models_or_the_sampled_distributions_log_probs(make_backend):
    """The transformers sampler applies the repetition penalty; `logprobs_of: sampler` reports the penalised,
    temperature-scaled distribution it drew from, `model` (the default) the model's own at the temperature. It
    cannot apply presence or frequency penalties: refused by name."""
    api = make_backend()
    prompts, model = [[5, 6, 7, 8, 9], [11, 12, 13]], api.sampler.model
    hot = {"temperature": 0.7, "repetition_penalty": 8.0}  # the tiny model's logits are small: a strong penalty
    drawn = api.generate(prompts, {"n": 2, "max_tokens": 10, "seed": 5, "logprobs_of": "sampler", **hot})
    reference = [sampled_distribution_logprobs(model, prompts[c.prompt_index], c.token_ids,
                                               {**hot, "presence_penalty": 0.0, "frequency_penalty": 0.0})
                 for c in drawn]
    assert max(abs(a - b) for c, r in zip(drawn, reference) for a, b in zip(c.logprobs, r)) < 1e-4
    own = api.generate(prompts, {"n": 2, "max_tokens": 10, "seed": 5, **hot})
    assert [c.token_ids for c in own] == [c.token_ids for c in drawn]  # the same draws, other log-probs reported
    scored = api.log_probs([Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids) for c in own],
                           temperature=0.7).logprobs
    assert max(abs(a - b) for c, lp in zip(own, scored) for a, b in zip(c.logprobs, lp)) < 1e-4
    assert max(abs(a - b) for c, d in zip(own, drawn) for a, b in zip(c.logprobs, d.logprobs)) > 1e-2
    with pytest.raises(InvalidRequest) as err:
        api.generate(prompts, {"max_tokens": 4, "presence_penalty": 0.5})
    assert err.value.field == "sampling.presence_penalty"


def test_ignore_eos_samples_on_past_the_end_of_sequence_token(make_backend):
    """Seeded alike, a sample that stopped at the end-of-sequence token goes on past it with `ignore_eos`, its
    log-probs still the model's."""
    api = make_backend()
    prompt, eos = [5, 6, 7], api.sampler.eos_ids[0]
    seed = next(s for s in range(100) if any(c.finish_reason == "stop" for c in api.generate(
        [prompt], SamplingParams(n=8, max_tokens=48, seed=s))))
    went_on = api.generate([prompt], SamplingParams(n=8, max_tokens=48, seed=seed, ignore_eos=True))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 48 for c in went_on)
    assert any(eos in c.token_ids[:-1] for c in went_on)
    scored = api.log_probs([Sequence(prompt_ids=prompt, response_ids=c.token_ids) for c in went_on]).logprobs
    assert max(abs(a - b) for c, lp in zip(went_on, scored) for a, b in zip(c.logprobs, lp)) < 1e-4


def test_a_job_resumed_from_its_checkpoint_samples_the_batch_the_saved_job_sampled_next(make_backend, tmp_path):
    """A checkpoint keeps the sampler's generators: a new job that loads it draws, unseeded, the completions the
    saved job drew next, so a synchronous RL run resumed samples its next step's batch again. (Both jobs share
    this process's generator, which the new job's start and the saved job's later draws moved on.)"""
    def draw(job) -> list[list[int]]:
        return [c.token_ids for c in job.generate([[5, 6, 7], [11, 12, 13, 14]], {"n": 4, "max_tokens": 8})]

    job = make_backend()
    job.fwd_bwd(grpo_batch(), "grpo")
    job.step()
    job.sync_weights()
    draw(job)
    job.save_checkpoint(str(tmp_path / "checkpoint"))
    next_batch, the_one_after = draw(job), draw(job)
    assert next_batch != the_one_after
    resumed = make_backend()
    resumed.load_checkpoint(str(tmp_path / "checkpoint"))
    assert draw(resumed) == next_batch
    # A generators' file that does not read is refused by name before anything is restored.
    resumed.fwd_bwd(grpo_batch(), "grpo")
    resumed.step()  # its weights now differ from the checkpoint's, which a partial load would write
    (tmp_path / "checkpoint" / "sampler_random_state.safetensors").write_bytes(b"not safetensors")
    before = weights(resumed)
    with pytest.raises(InvalidRequest, match="sampler's generators") as err:
        resumed.load_checkpoint(str(tmp_path / "checkpoint"))
    assert err.value.field == "path" and all(torch.equal(w, before[n]) for n, w in weights(resumed).items())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_weights_only_restore_trains_on_as_a_new_job_from_those_weights(make_backend, tiny_model, tmp_path, stage):
    """`load_checkpoint(optimizer=False)` (Tinker's load_state; RL from an SFT checkpoint): the checkpoint's weights
    with a fresh optimizer. The reference is a new job whose model is those weights, exported to a Hugging Face
    folder: its AdamW never stepped."""
    from transformers import AutoModelForCausalLM

    trained = make_backend(zero_stage=stage)
    for _ in range(2):
        trained.fwd_bwd(grpo_batch(), "grpo")
        trained.step(learning_rate=1e-2)
    checkpoint = str(tmp_path / "checkpoint")
    trained.save_checkpoint(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.load_state_dict(weights(trained))
    model.save_pretrained(tmp_path / "exported")
    for name in os.listdir(tiny_model):  # its tokenizer
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(tiny_model, name), tmp_path / "exported")
    trained.fwd_bwd(grpo_batch(), "grpo")  # the moments move on past the checkpoint
    trained.step(learning_rate=1e-2)
    trained.load_checkpoint(checkpoint, optimizer=False)
    trained.save_checkpoint(str(tmp_path / "fresh"))  # a fresh optimizer saves and loads (a tenant parked, say)
    trained.load_checkpoint(str(tmp_path / "fresh"))
    new_job = make_backend(model_path=str(tmp_path / "exported"), zero_stage=stage)
    resumed = make_backend(zero_stage=stage)
    resumed.load_checkpoint(checkpoint)  # with its optimizer: the moments of two steps
    batch = grpo_batch(groups=3)
    for backend in (trained, new_job, resumed):
        backend.fwd_bwd(batch, "grpo")
        backend.step(learning_rate=1e-2)
    restored, new = weights(trained), weights(new_job)
    assert all(torch.allclose(restored[n], new[n], rtol=1e-6, atol=1e-8) for n in new)
    assert not all(torch.allclose(w, new[n], rtol=1e-6, atol=1e-8) for n, w in weights(resumed).items())
