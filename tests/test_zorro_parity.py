"""ZoRRo parity: per-token log-probs, loss and every parameter's gradient equal the unshared
computation (a right-padded batch, one sequence per row, with the model's own eager attention) for
Qwen3, Qwen2, Llama, Gemma 2 (softcaps, a sliding window of 8) and Granite (scaled logits).
tests/test_model_families.py sweeps every other family."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.engines.response_logits import ResponseLogits
from arctic_rl_core.losses.grpo import GRPOConfig, grpo_loss
from arctic_rl_core.losses.post_processors import compute_logprobs
from arctic_rl_core.models.head import output_head
from arctic_rl_core.types import Sequence
from arctic_rl_core.zorro.attention import ZORRO_ATTENTION

VOCAB = 400


def tokens(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def grpo_groups(rng, groups, max_group, prompt_lens, response_lens, with_group_id=True):
    seqs = []
    for g in range(groups):
        prompt = tokens(rng, rng.choice(prompt_lens))
        for _ in range(rng.randint(1, max_group)):
            r = rng.choice(response_lens)
            seqs.append(Sequence(prompt_ids=prompt, response_ids=tokens(rng, r), group_id=g if with_group_id else None,
                                 advantages=[rng.uniform(-1, 1)] * r, behaviour_logprobs=[-rng.uniform(4, 8) for _ in range(r)]))
    return seqs


def multi_turn(rng):
    """A conversation whose later turns extend earlier ones, and a system prompt shared by two groups."""
    system = tokens(rng, 7)
    turn1, reply1 = system + tokens(rng, 5), tokens(rng, 4)
    turn2 = turn1 + reply1 + tokens(rng, 3)
    seqs = [Sequence(prompt_ids=turn1, response_ids=reply1), Sequence(prompt_ids=turn1, response_ids=tokens(rng, 6))]
    seqs += [Sequence(prompt_ids=turn2, response_ids=tokens(rng, n)) for n in (1, 5, 2)]
    other = system + tokens(rng, 4)
    seqs += [Sequence(prompt_ids=other, response_ids=tokens(rng, n), group_id="other") for n in (3, 3, 1)]
    seqs += [Sequence(prompt_ids=tokens(rng, 1), response_ids=tokens(rng, 1))]  # nothing shared
    for s in seqs:
        n = len(s.response_ids)
        s.advantages = [rng.uniform(-1, 1)] * n
        s.behaviour_logprobs = [-rng.uniform(4, 8) for _ in range(n)]
    rng.shuffle(seqs)
    return seqs


@pytest.fixture(scope="module")
def models(tiny_models):
    out = {}
    for family, path in tiny_models.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ZORRO_ATTENTION, dtype=torch.float32)
        # Random init is nearly uniform; scale up so attention patterns (and errors) are not washed out.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(4.0)
        # The reference: the same weights with the family's own eager attention (SDPA drops Gemma 2's softcap).
        reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
        reference.load_state_dict(model.state_dict())
        out[family] = (model, reference)
    return out


def run(model, sequences, forest, budget=100_000, backend="auto"):
    model.zero_grad(set_to_none=True)
    wrapper = ResponseLogits(model, model, output_head(model.config), zorro_backend=backend)
    logprobs = [None] * len(sequences)
    total = 0.0
    for mb in build_micro_batches(sequences, token_budget=budget, weight_version=0, forest=forest):
        logits = wrapper(mb.input_ids, mb.logit_rows, mb.attention_mask, mb.position_ids, mb.layout)
        lp = compute_logprobs({"logits": logits, "targets": mb.targets}, mb.inputs, None)["logprobs"]
        loss, _ = grpo_loss({"logprobs": lp}, mb.inputs, GRPOConfig(eps_clip=0.2, eps_clip_higher=0.28))
        loss.backward()
        total += loss.item()
        offset = 0
        for i, n in zip(mb.sequence_ids, mb.response_lengths):
            logprobs[i] = lp[offset : offset + n].detach()
            offset += n
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return torch.cat(logprobs), total, grads


def assert_parity(models, sequences, **forest_kwargs):
    model, reference = models
    lp_ref, loss_ref, g_ref = run(reference, sequences, forest=False)
    lp, loss, g = run(model, sequences, forest=True, **forest_kwargs)
    assert (lp - lp_ref).abs().max() <= 1e-5 * lp_ref.abs().max()
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-7)
    # Relative error per parameter; a parameter whose exact gradient is 0 (a query projection when every
    # prediction comes from a one-token context) is held to 1e-6 of the model's whole gradient instead.
    floor = 1e-6 * torch.cat([r.flatten() for r in g_ref.values()]).norm()
    for name, ref in g_ref.items():
        assert (g[name] - ref).norm() <= max(1e-5 * ref.norm(), floor), name


FAMILIES = ["qwen3", "qwen2", "llama", "gemma2", "granite"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_random_groups_sizes_1_to_16(models, family, seed):
    rng = random.Random(seed)
    seqs = grpo_groups(rng, groups=rng.randint(1, 3), max_group=16, prompt_lens=[1, 2, 9, 30], response_lens=[1, 2, 7, 15])
    rng.shuffle(seqs)
    assert_parity(models[family], seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_of_one(models, family):
    rng = random.Random(7)
    seqs = grpo_groups(rng, groups=2, max_group=4, prompt_lens=[1], response_lens=[1])
    assert_parity(models[family], seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_shared_and_unshared_without_group_ids(models, family):
    rng = random.Random(3)
    seqs = grpo_groups(rng, groups=2, max_group=6, prompt_lens=[12], response_lens=[3, 8], with_group_id=False)
    seqs += grpo_groups(rng, groups=3, max_group=1, prompt_lens=[5, 11], response_lens=[4])
    rng.shuffle(seqs)
    assert_parity(models[family], seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_partial_prefixes(models, family):
    assert_parity(models[family], multi_turn(random.Random(11)))


@pytest.mark.parametrize("backend", ["cpu_flash", "math", "triton"])
def test_groups_split_across_micro_batches(models, backend):
    rng = random.Random(5)
    seqs = grpo_groups(rng, groups=2, max_group=12, prompt_lens=[20], response_lens=[3, 6])
    assert_parity(models["qwen3"], seqs, budget=40, backend=backend)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_the_fused_kernel_equals_the_models_own_attention(models, family):
    """The fused Triton forest kernel in a model (interpreted without a GPU): GQA K/V read per query head, and
    Gemma 2's sliding window and softcap, against the family's eager attention."""
    rng = random.Random(7)
    assert_parity(models[family], grpo_groups(rng, groups=2, max_group=4, prompt_lens=[18], response_lens=[2, 7]),
                  backend="triton")


def test_sharing_removes_the_redundant_tokens():
    rng = random.Random(0)
    prompt = tokens(rng, 50)
    seqs = [Sequence(prompt_ids=prompt, response_ids=tokens(rng, 5), group_id=0) for _ in range(8)]
    [packed] = build_micro_batches(seqs, token_budget=10_000, weight_version=0, forest=True)
    assert packed.input_ids.shape[1] == 50 + 8 * 5  # P + G*R, not G*(P+R)
    [plain] = build_micro_batches(seqs, token_budget=10_000, weight_version=0, forest=False)
    assert int(plain.attention_mask.sum()) == 8 * 55
