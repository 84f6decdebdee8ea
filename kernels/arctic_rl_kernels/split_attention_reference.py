"""Plain PyTorch split attention over a prefix forest: the definition the fast path must match.

Dense [N, N] scores and mask: only for tests and small inputs.
"""

from __future__ import annotations

import torch

from arctic_rl_kernels.layout import ForestLayout


def split_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ForestLayout, scale: float, *,
                              softcap: float | None = None, window: int | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v: [H, N, D] over the packed tokens; returns [H, N, D]. Softcap, window and sinks as in
    `split_attention`: the sink is one more score column whose value is zero."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~layout.dense_mask(window).to(q.device), float("-inf"))
    if sinks is not None:
        column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v.float()).to(q.dtype)
