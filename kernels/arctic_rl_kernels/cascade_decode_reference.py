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


def merge_reference(part_out: torch.Tensor, part_lse: torch.Tensor, seq_slot_start: torch.Tensor,
                    seq_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of split partials, part_out [slots, H, DV] and part_lse [slots, H]: sequence b's output is
    sum_i exp(lse_i - lse) * out_i over its slots i = seq_slots[seq_slot_start[b] : seq_slot_start[b + 1]], and
    lse = logsumexp_i lse_i. Returns out [B, H, DV] and lse [B, H], fp32."""
    out, lse = [], []
    for first, last in zip(seq_slot_start[:-1].tolist(), seq_slot_start[1:].tolist()):
        slots = seq_slots[first:last].long()
        top = part_lse[slots].max(0).values
        w = torch.exp(part_lse[slots] - top)  # [slots, H]
        den = w.sum(0)
        out.append((part_out[slots].float() * w[..., None]).sum(0) / den[..., None])
        lse.append(top + torch.log(den))
    return torch.stack(out), torch.stack(lse)
