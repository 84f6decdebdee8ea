"""Through the public API: log-probs are the model's own for families with softcaps, windows and scaled
logits, with ZoRRo on, off, and switched at run time; families ZoRRo cannot serve are refused at load,
naming the family and the feature, and train with zorro.enable=false."""

import os
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from arctic_rl_core.errors import InvalidRequest
from tests.helpers import grpo_batch


def own_logprobs(model_dir, seqs, attention="eager"):
    """The model's own forward of each sequence alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist())
    return out


def max_err(a, b):
    return max(abs(x - y) for r, q in zip(a, b) for x, y in zip(r, q))


def long_batch():
    # Prompts and responses longer than Gemma 2's window of 8: the window matters, across the prefix boundary.
    return grpo_batch(groups=2, group_size=3, prompt_len=14, response_len=9, vocab=500)


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_logprobs_are_the_models_own_with_zorro_on_off_and_switched(tiny_models, make_backend, family):
    seqs = long_batch()
    own = own_logprobs(tiny_models[family], seqs)
    backend = make_backend(model_path=tiny_models[family])
    assert max_err(backend.log_probs(seqs).logprobs, own) <= 2e-6
    backend.config.zorro.enable = False  # at run time: the same split attention, one padded row per sequence
    assert max_err(backend.log_probs(seqs).logprobs, own) <= 2e-6
    off = make_backend(model_path=tiny_models[family], zorro=False)  # ZoRRo's attention all the same: no packing
    assert max_err(off.log_probs(seqs).logprobs, own) <= 2e-6
    off.config.zorro.enable = True  # the one switch: packing turned on at run time gives the same numbers
    assert max_err(off.log_probs(seqs).logprobs, own) <= 2e-6


def test_gemma2_trains_with_zorro_and_gradients_match_zorro_off(tiny_models, make_backend):
    seqs = long_batch()
    grads = []
    for zorro in (True, False):
        backend = make_backend(model_path=tiny_models["gemma2"], zorro=zorro, zero_stage=0)
        backend.fwd_bwd(seqs, "grpo")
        module = backend.engine.engine.module
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).norm() <= 1e-5 * grads[1].norm()


def random_model(family_config, out_dir, tokenizer_dir):
    """A random model of any family, with the tiny models' tokenizer."""
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name == "special_tokens_map.json":
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    vocab = AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    family_config.vocab_size = vocab
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(family_config).save_pretrained(out_dir)
    return out_dir


def test_a_router_that_samples_experts_while_training_gives_its_inference_logprobs(tmp_path, tiny_model, make_backend):
    """PhiMoE's sparsemixer samples experts in training mode; the engine runs the inference forward
    (gradients flow all the same), so log-probs are the sampler's and repeat exactly."""
    from transformers import PhimoeConfig

    config = PhimoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                          eos_token_id=0, router_jitter_noise=0.5)
    model_dir = random_model(config, str(tmp_path), tiny_model)
    seqs = long_batch()
    for zorro in (True, False):
        backend = make_backend(model_path=model_dir, zorro=zorro, gradient_checkpointing=True)
        first = backend.log_probs(seqs).logprobs
        assert backend.log_probs(seqs).logprobs == first
        backend.fwd_bwd(seqs, "grpo")
        assert backend.log_probs(seqs).logprobs == first
        assert max_err(first, own_logprobs(model_dir, seqs, "sdpa")) <= 2e-6


@pytest.mark.parametrize("config, feature", [
    # Its decoder layers do not pass the layout on: attention would run over the whole pack.
    ("stablelm", "was not given the ZoRRo layout"),
    # Chunked attention (a mask rule transformers applies), refused by name before any weight is read.
    ("llama4_text", "chunked attention"),
])
def test_families_zorro_cannot_serve_are_refused_at_load_and_train_without_it(tmp_path, tiny_model, make_backend,
                                                                              config, feature):
    from transformers import CONFIG_MAPPING

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=0)
    if config == "llama4_text":
        sizes.update(num_local_experts=2, num_experts_per_tok=1, head_dim=32, attention_chunk_size=8,
                     intermediate_size_mlp=128)
    model_dir = random_model(CONFIG_MAPPING[config](**sizes), str(tmp_path), tiny_model)
    with pytest.raises(InvalidRequest) as err:
        make_backend(model_path=model_dir)
    assert err.value.field == "zorro.enable"
    assert config in err.value.message and feature in err.value.message and "zorro.enable=false" in err.value.message
    backend = make_backend(model_path=model_dir, zorro=False)  # its own attention: the engine's default, SDPA
    seqs = long_batch()
    backend.config.zorro.enable = True  # packing cannot be turned on for a model running its own attention
    before = backend.state_digest()
    with pytest.raises(InvalidRequest) as err:
        backend.fwd_bwd(seqs, "grpo")
    assert err.value.field == "zorro.enable" and backend.state_digest() == before
    backend.config.zorro.enable = False
    assert max_err(backend.log_probs(seqs).logprobs, own_logprobs(model_dir, seqs, "sdpa")) <= 2e-6
    backend.fwd_bwd(seqs, "grpo")
    backend.step()


@pytest.mark.parametrize("checkpointing, forwards", [(True, 2), (False, 1)])
def test_gradient_checkpointing_still_recomputes_in_the_inference_forward(make_backend, checkpointing, forwards):
    backend = make_backend(gradient_checkpointing=checkpointing, zero_stage=0, micro_batch_tokens=10**6)
    module = backend.engine.engine.module
    assert not any(m.training for m in module.modules() if isinstance(m, torch.nn.Dropout))
    calls = []
    mlp = next(m for name, m in module.named_modules() if name.endswith("layers.0.mlp"))
    forward = mlp.forward

    def counted(*args, **kwargs):  # (forward hooks do not fire in a checkpoint's recompute)
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    backend.fwd_bwd(grpo_batch(), "grpo")  # one micro-batch: checkpointing runs the layer again in backward
    assert len(calls) == forwards


def test_gemma2_under_zero3_gives_its_own_logprobs_and_trains(tiny_models, make_backend):
    """ZeRO-3 gathers the head's weights for each chunk, in forward and in backward's recompute."""
    seqs = long_batch()
    own = own_logprobs(tiny_models["gemma2"], seqs)  # first: a ZeRO-3 engine partitions models loaded beside it
    backend = make_backend(model_path=tiny_models["gemma2"], zero_stage=3)
    backend.engine.engine.module.chunk_elements = 4 * backend.engine.vocab_size  # four rows a chunk
    assert max_err(backend.log_probs(seqs).logprobs, own) <= 2e-6
    digest = backend.state_digest()
    backend.fwd_bwd(seqs, "grpo")
    backend.step()
    assert backend.state_digest() != digest
