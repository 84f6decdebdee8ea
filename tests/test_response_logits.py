"""The chunked log-prob path (built-in post-processors only) against the full-logits path: values,
entropy and gradients, with no lm_head call wider than one chunk, in forward or in backward."""

import random

import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.engines.response_logits import ResponseLogits
from arctic_rl_core.losses.post_processors import apply_temperature, compute_entropy, compute_logprobs, TemperatureConfig
from arctic_rl_core.models.head import output_head
from arctic_rl_core.zorro.attention import ZORRO_ATTENTION
from tests.helpers import grpo_batch


def test_chunked_logprobs_and_entropy_equal_the_full_logits_path(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gemma2"], attn_implementation=ZORRO_ATTENTION,
                                                 dtype=torch.float32)
    wrapper = ResponseLogits(model, model, output_head(model.config))
    vocab = model.get_output_embeddings().weight.shape[0]
    [mb] = build_micro_batches(grpo_batch(prompt_len=12, response_len=7, vocab=500), token_budget=10**6,
                               weight_version=0, forest=True)
    batch = (mb.input_ids, mb.logit_rows, mb.attention_mask, mb.position_ids, mb.layout)
    weights = torch.tensor([random.Random(0).uniform(-1, 1) for _ in range(len(mb.targets))])

    def grads_of(logprobs, entropy):
        model.zero_grad(set_to_none=True)
        ((logprobs * weights).sum() + 0.1 * entropy.sum()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    outputs = {"logits": wrapper(*batch), "targets": mb.targets}
    outputs.update(apply_temperature(outputs, None, TemperatureConfig(temperature=0.7)))
    full_lp = compute_logprobs(outputs, None, None)["logprobs"]
    full_ent = compute_entropy(outputs, None, None)["entropy"]
    full_grads = grads_of(full_lp, full_ent)

    widths = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: widths.append(out.shape[0]))
    wrapper.chunk_elements = 3 * vocab  # three rows at a time
    chunked = wrapper(*batch, targets=mb.targets, temperature=0.7, with_entropy=True)
    chunked_grads = grads_of(chunked["logprobs"], chunked["entropy"])

    assert len(mb.targets) > 9 and widths and max(widths) <= 3  # forward and backward's recompute alike
    # (the head's matmul over three rows rounds differently from one over all of them: fp32 parity)
    assert torch.allclose(chunked["logprobs"], full_lp, rtol=1e-5, atol=1e-6)
    assert torch.allclose(chunked["entropy"], full_ent, rtol=1e-5, atol=1e-6)
    assert (chunked_grads - full_grads).norm() <= 1e-5 * full_grads.norm()
