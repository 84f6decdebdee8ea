"""Plain PyTorch split attention over a prefix forest: the definition the fast path must match.

Dense [N, N] scores and mask: only for tests and small inputs.
"""

from __future__ import annotations

import torch

from arctic_rl_kernels.layout import ForestLayout


def split_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ForestLayout, scale: float) -> torch.Tensor:
    """q, k, v: [H, N, D] over the packed tokens; returns [H, N, D]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~layout.dense_mask().to(q.device), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
