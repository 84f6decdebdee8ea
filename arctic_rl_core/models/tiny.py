"""Tiny random-initialised models of real families, with a locally trained tokenizer.

Nothing can be downloaded in our CI, so tests, benchmarks and the demo build
their models here: a real Hugging Face config and architecture (Qwen3, Qwen2,
Llama; Gemma 2 with its attention and final softcaps and a short sliding window,
Granite with its scaled logits) at small size, and a byte-level BPE tokenizer
trained with the `tokenizers` library on a small built-in corpus.
"""

from __future__ import annotations

import os
from typing import Literal

Family = Literal["qwen3", "qwen2", "llama", "gemma2", "granite", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
FAMILIES: tuple[str, ...] = ("qwen3", "qwen2", "llama", "gemma2", "granite")
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
"""Mixture-of-experts families (default 4 experts, 2 per token, every layer sparse): router replay's."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  # Qwen3's tool and reasoning markers: its renderers (PrimeRL's) need them in the vocabulary.
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. A model reads a question and writes an answer.
SELECT name, age FROM users WHERE age > 30 ORDER BY name; SELECT COUNT(*) FROM orders GROUP BY city;
CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT);
INSERT INTO orders VALUES (1, 'alice', 42.5); SELECT AVG(price) FROM items JOIN shops ON items.shop = shops.id;
Which city has the most customers? How many orders were placed in 2024? What is the capital of France?
Paris is the capital of France. Berlin is the capital of Germany. The river flows through the valley.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = < > ( ) [ ] { } , . ; : ' " ? !
question: answer: context: title: paragraph: reasoning step by step, the answer is
"""


# ChatML, as Qwen's templates write it: tools in the system turn, calls as <tool_call> blocks, tool results as
# user turns; like Qwen3's, the reasoning (up to </think>) of assistant turns before the last user message is
# dropped, so a conversation's later prompts do not always extend its earlier ones token for token.
CHAT_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set last_user = namespace(index=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set last_user.index = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not loop.first %}{{ raise_exception('a system message must come first') }}{% endif %}
{%- elif m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}{% set content = m.content or '' %}
{%- if loop.index0 < last_user.index and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}<|im_start|>assistant
{{ content }}{% for call in m.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}{{ raise_exception('unknown role ' ~ m.role) }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def train_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer in transformers' fast-tokenizer format, trained on `corpus`
    (default: a small built-in one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if corpus is None:
        corpus = [line for line in _CORPUS.strip().splitlines() if line.strip()] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )


QWEN3_0_6B = dict(layers=28, hidden=1024, heads=16, kv_heads=8,
                  shape=dict(intermediate=3072, head_dim=128, tie_embeddings=True, model_vocab=151936))
"""Qwen3-0.6B's shape (its config.json), with random weights: `make_tiny_model("qwen3", dir, **QWEN3_0_6B)`."""


def tiny_config(family: Family, *, vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int,
                max_positions: int, eos_token_id: int, intermediate: int | None = None, head_dim: int | None = None,
                tie_embeddings: bool = False, experts: int = 4, experts_per_token: int = 2):
    from transformers import (Gemma2Config, GraniteConfig, LlamaConfig, MixtralConfig, OlmoeConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tie_embeddings,
    )
    head_dim = head_dim or hidden // heads
    if family == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=head_dim, num_experts=experts, num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                              moe_intermediate_size=intermediate or hidden, decoder_sparse_step=1, **common)
    if family == "qwen2_moe":  # with its shared expert, gated
        return Qwen2MoeConfig(num_experts=experts, num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                              moe_intermediate_size=intermediate or hidden, shared_expert_intermediate_size=hidden,
                              decoder_sparse_step=1, **common)
    if family == "mixtral":  # softmax over the chosen experts' logits, always renormalised
        return MixtralConfig(head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=experts_per_token,
                             sliding_window=None, **common)
    if family == "olmoe":  # softmax over all experts, not renormalised
        return OlmoeConfig(num_experts=experts, num_experts_per_tok=experts_per_token, norm_topk_prob=False, **common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "llama":
        return LlamaConfig(head_dim=head_dim, **common)
    if family == "gemma2":
        # Softcaps low enough to bend real logits, and a window shorter than the test sequences.
        # Tied embeddings, as every Gemma 2 (vLLM's Gemma 2 has no separate LM head).
        return Gemma2Config(head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads, attn_logit_softcapping=5.0,
                            final_logit_softcapping=3.0, sliding_window=8, **{**common, "tie_word_embeddings": True})
    if family == "granite":
        return GraniteConfig(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                             attention_multiplier=(hidden // heads) ** -0.5, **common)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES + MOE_FAMILIES)}")


def make_tiny_model(family: Family, out_dir: str, *, layers: int = 2, hidden: int = 64, heads: int = 2,
                    kv_heads: int = 1, vocab_size: int = 512, max_positions: int = 2048, seed: int = 0,
                    corpus: list[str] | None = None, shape: dict | None = None) -> str:
    """Write a random-initialised model and its tokenizer to `out_dir`; return the directory.

    The default head size is 32: vLLM's CPU attention kernels support no smaller one. `shape` overrides the
    config's size (`intermediate`, `head_dim`, `tie_embeddings`, `model_vocab`: a vocabulary larger than the
    tokenizer's, for a real model's LM-head cost; `experts`, `experts_per_token` of a MoE), e.g. `QWEN3_0_6B`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES + MOE_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES + MOE_FAMILIES)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, and heads a multiple of kv_heads")
    tokenizer = train_tokenizer(vocab_size, corpus)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    shape = dict(shape or {})
    config = tiny_config(family, vocab_size=max(len(tokenizer), shape.pop("model_vocab", 0)), layers=layers, hidden=hidden,
                         heads=heads, kv_heads=kv_heads, max_positions=max_positions, eos_token_id=eos, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
