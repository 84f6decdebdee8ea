"""The FLOP-bound ratio ZoRRo can reach for a model and a GRPO shape.

Forward FLOPs ~ 2 * N_lin * tokens + 4 * L * d_attn * causal_pairs + 2 * V * d * predicted_tokens;
backward scales the same, so one ratio serves fwd_bwd and log_probs.
Per group of G responses of length R sharing a prompt of length P:
  unshared: tokens G(P+R),  pairs G(P+R)^2/2
  shared:   tokens P + GR,  pairs P^2/2 + G(PR + R^2/2)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    prompt_len: int
    response_len: int
    group: int
    groups: int


def linear_params_per_layer(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return attention + mlp


def forward_flops(config, shape: Shape, shared: bool) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_lin = config.num_hidden_layers * linear_params_per_layer(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim, config.intermediate_size
    )
    d_attn = config.num_attention_heads * head_dim
    P, R, G, N = shape.prompt_len, shape.response_len, shape.group, shape.groups
    if shared:
        tokens = N * (P + G * R)
        pairs = N * (P * P / 2 + G * (P * R + R * R / 2))
    else:
        tokens = N * G * (P + R)
        pairs = N * G * (P + R) ** 2 / 2
    predicted = N * G * R
    return 2 * n_lin * tokens + 4 * config.num_hidden_layers * d_attn * pairs + 2 * config.vocab_size * config.hidden_size * predicted


def theoretical_speedup(config, shape: Shape) -> float:
    return forward_flops(config, shape, shared=False) / forward_flops(config, shape, shared=True)
