"""ZoRRo's attention, registered in transformers' attention-implementation registry.

A model loaded with `attn_implementation=ZORRO_ATTENTION` runs split attention
when its forward is given `zorro_layout=` (a packed prefix forest, batch of 1),
and plain causal SDPA otherwise, which is exact for right-padded batches.
No model class is patched: the name is registered with `AttentionInterface`
and no mask function is registered for it, so transformers builds no dense
mask over the pack.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from arctic_rl_kernels.layout import ForestLayout
from arctic_rl_kernels.split_attention import split_attention

ZORRO_ATTENTION = "arctic_rl_zorro"


def zorro_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    zorro_layout: ForestLayout | None = None,
    zorro_backend: str = "auto",
    **kwargs,
):
    if zorro_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    unsupported = {"sliding_window": sliding_window, "softcap": softcap, "attention dropout": dropout or None}
    used = [name for name, value_ in unsupported.items() if value_]
    if used:
        raise NotImplementedError(f"ZoRRo split attention does not support {', '.join(used)}; set zorro.enable=false")
    if query.shape[0] != 1:
        raise ValueError("ZoRRo packs a micro-batch into one row; got batch size {query.shape[0]}")
    groups = getattr(module, "num_key_value_groups", query.shape[1] // key.shape[1])
    k = repeat_kv(key, groups)[0]
    v = repeat_kv(value, groups)[0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = split_attention(query[0], k, v, zorro_layout, scale, backend=zorro_backend)
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


AttentionInterface.register(ZORRO_ATTENTION, zorro_attention_forward)
