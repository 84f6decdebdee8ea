"""ZoRRo's attention, registered in transformers' attention-implementation registry.

A model loaded with `attn_implementation=ZORRO_ATTENTION` runs split attention over the
packed prefix forest its forward is given as `zorro_layout=` (a batch of 1). Without one,
each row of a right-padded batch is its own sequence (exact for the real tokens: padding
comes after them): causal SDPA, or split attention per row where the family needs a window,
a softcap or sinks. Both paths apply what the family passes its attention — scaling, sliding
window, logit softcap, sinks (`s_aux`) — so turning ZoRRo on and off at run time gives the
same numbers. No model class is patched: the name is
registered with `AttentionInterface` and no mask function is registered for it, so
transformers builds no dense mask over the pack. Training forwards only: no KV cache.

A family whose decoder layers drop extra keyword arguments never hands the layout to its
attention; `expect_layout` turns that into an error instead of attention over the whole pack.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from arctic_rl_kernels.layout import ForestLayout
from arctic_rl_kernels.split_attention import split_attention

ZORRO_ATTENTION = "arctic_rl_zorro"


class LayoutNotDelivered(RuntimeError):
    """The model's forward got a layout but one of its attention modules did not."""


class Delivery:
    """The attention calls of one forward that was given a layout."""

    def __init__(self, layout: ForestLayout):
        self.layout = layout
        self.calls = 0
        self.windows: set[int] = set()
        """Sliding windows the calls were given (a family applying its window only through transformers'
        mask gives none: the load-time probe refuses it)."""
        self.shapes: set[tuple] = set()
        """(query heads, KV heads, head size, value head size, softcap, window, with sinks) of each distinct call:
        what the load-time probe runs split attention's backward at."""


_delivery: contextvars.ContextVar[Delivery | None] = contextvars.ContextVar("zorro_delivery", default=None)


@contextmanager
def expect_layout(layout: ForestLayout):
    """Every attention call inside must receive `layout`; yields the `Delivery` that counts them. Checked
    where the forward runs, not in a gradient-checkpointing recompute, which replays the keyword
    arguments it captured."""
    delivery = Delivery(layout)
    token = _delivery.set(delivery)
    try:
        yield delivery
    finally:
        _delivery.reset(token)


def _expand_kv(module: torch.nn.Module, query: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    groups = getattr(module, "num_key_value_groups", query.shape[1] // x.shape[1])
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# Keyword arguments families pass that do not change what attention computes.
_NEUTRAL_ARGUMENTS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "output_router_logits"})


def _refuse_what_split_attention_does_not_apply(module, attention_mask, kwargs) -> None:
    """Attention that is not causal softmax attention (with the features `zorro_attention_forward`
    applies) is an error, never a silently different result: the load-time probe turns it into a refusal."""
    name = type(module).__name__
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal", True) is False:
        raise ValueError(f"{name} is not causal attention")
    if attention_mask is not None:
        raise ValueError(f"{name} builds its own attention mask, which split attention does not apply")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL_ARGUMENTS | {"is_causal"})
    if unknown:
        raise ValueError(f"{name} passes {', '.join(unknown)} to its attention, which split attention does not apply")


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
    s_aux: torch.Tensor | None = None,
    zorro_layout: ForestLayout | None = None,
    zorro_backend: str = "auto",
    **kwargs,
):
    if dropout:
        raise ValueError("ZoRRo attention runs without attention dropout (RL log-probs must be deterministic)")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError("ZoRRo attention runs training forwards over whole sequences, not a KV cache")
    _refuse_what_split_attention_does_not_apply(module, attention_mask, kwargs)
    delivery = _delivery.get()
    if delivery is not None:
        if zorro_layout is not delivery.layout:
            raise LayoutNotDelivered(f"{type(module).__name__} was not given the ZoRRo layout by its decoder layer")
        delivery.calls += 1
        if sliding_window is not None:
            delivery.windows.add(int(sliding_window))
        delivery.shapes.add((query.shape[1], key.shape[1], query.shape[-1], value.shape[-1], softcap, sliding_window,
                             s_aux is not None))
    B, H, L, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    if zorro_layout is None and sliding_window is None and softcap is None and s_aux is None:
        # Plain causal attention per row is all a right-padded batch needs: ATen's fused kernel, no gathers.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, _expand_kv(module, query, key), _expand_kv(module, query, value), is_causal=True, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    if zorro_layout is None:
        layout = ForestLayout.unshared([L] * B)  # each padded row its own sequence
    elif B != 1:
        raise ValueError(f"ZoRRo packs a micro-batch into one row; got batch size {B}")
    else:
        layout = zorro_layout
    # K/V keep their own heads (GQA): split attention reads them per query head without repeating them.
    q = query.transpose(0, 1).reshape(H, B * L, D)
    k = key.transpose(0, 1).reshape(key.shape[1], B * L, D)
    v = value.transpose(0, 1).reshape(value.shape[1], B * L, value.shape[-1])
    out = split_attention(q, k, v, layout, scale, backend=zorro_backend, softcap=softcap, window=sliding_window, sinks=s_aux)
    # [H, B*L, D] -> [B, L, H, D], the layout transformers' attention functions return.
    return out.reshape(H, B, L, -1).permute(1, 2, 0, 3).contiguous(), None


AttentionInterface.register(ZORRO_ATTENTION, zorro_attention_forward)
