"""Plain PyTorch cascade decode: the definition the Triton kernel must match.

Gathers each sequence's keys and values and repeats them per query head: only for tests and small inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from arctic_rl_kernels.cascade_decode import DecodeForest


def cascade_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, forest: DecodeForest,
                             scale: float) -> torch.Tensor:
    """q [B, H, D], k_cache [Hkv, T, D], v_cache [Hkv, T, DV]; sequence b attends, in fp32, to the keys of
    the segments in forest.chains[b]. Returns [B, H, DV] in q's dtype."""
    group = q.shape[1] // k_cache.shape[0]
    out = []
    for b, chain in enumerate(forest.chains):
        idx = torch.cat([torch.arange(*forest.segments[i]) for i in chain]).to(q.device)
        k = k_cache[:, idx].float().repeat_interleave(group, dim=0)  # [H, L, D]
        v = v_cache[:, idx].float().repeat_interleave(group, dim=0)
        scores = (k @ q[b].float()[:, :, None])[..., 0] * scale  # [H, L]
        out.append((torch.softmax(scores, dim=-1)[:, None, :] @ v)[:, 0])  # [H, DV]
    return torch.stack(out).to(q.dtype)
