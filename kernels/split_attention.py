"""Split attention over a prefix forest: each segment's causal self-attention, plus, for every
segment with descendants, one unmasked attention of its whole subtree's queries to its keys,
merged by log-sum-exp.

No key/value is copied per suffix: a prefix's K/V is read once by one call for all of its
descendants, and in backward its gradient is the sum over them. Backward follows the
ring-attention identity: each part's flash backward, fed the *merged* output and LSE, gives
exactly that part's share of dQ, dK, dV.

Primitives (`AttentionOps`) are swappable: `cpu_flash` uses ATen's CPU flash-attention
kernels; `math` is matmul-based, tiled over queries, and runs on any device. A Triton
kernel is one more `AttentionOps`; callers do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from arctic_rl_kernels.layout import ForestLayout

# Padded query rows get this LSE in backward, so exp(score - lse) == 0 there.
_PAD_LSE = 1e30


@dataclass(frozen=True)
class AttentionOps:
    """forward(q, k, v, causal, scale) -> (out, lse); backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv).
    Tensors are [B, H, L, D]; lse is [B, H, L] in float32."""

    name: str
    forward: Callable
    backward: Callable


def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


_QUERY_TILE = 1024


def _scores(q, k, causal, scale, q_offset):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(q_offset, q_offset + q.shape[-2], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    outs, lses = [], []
    for t in range(0, q.shape[-2], _QUERY_TILE):
        s = _scores(q[..., t : t + _QUERY_TILE, :], k, causal, scale, t)
        lse = torch.logsumexp(s, dim=-1)
        outs.append((torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    dq = torch.empty_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for t in range(0, q.shape[-2], _QUERY_TILE):
        sl = slice(t, t + _QUERY_TILE)
        qt, dot = q[..., sl, :].float(), dout[..., sl, :].float()
        p = torch.exp(_scores(qt, k, causal, scale, t) - lse[..., sl, None])
        dv += p.transpose(-1, -2) @ dot
        dp = dot @ v.float().transpose(-1, -2)
        delta = (dot * out[..., sl, :].float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq[..., sl, :] = (ds @ k.float()) * scale
        dk += (ds.transpose(-1, -2) @ qt) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CPU_FLASH = AttentionOps("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
MATH = AttentionOps("math", _math_forward, _math_backward)
BACKENDS = {"cpu_flash": CPU_FLASH, "math": MATH}


def select_ops(name: str, device: torch.device) -> AttentionOps:
    if name == "auto":
        return CPU_FLASH if device.type == "cpu" else MATH
    if name not in BACKENDS:
        raise ValueError(f"unknown split-attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]


def _bucket_index(layout: ForestLayout, members: list[int], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, width] packed indices of each member segment's tokens (0 where padded) and the validity mask."""
    idx = torch.zeros((len(members), width), dtype=torch.long)
    valid = torch.zeros((len(members), width), dtype=torch.bool)
    for row, seg in enumerate(members):
        n = layout.ends[seg] - layout.starts[seg]
        idx[row, :n] = torch.arange(layout.starts[seg], layout.ends[seg])
        valid[row, :n] = True
    return idx.to(device), valid.to(device)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[H, N, D] -> [n, H, width, D]."""
    return x[:, idx].permute(1, 0, 2, 3)


def _forward(q, k, v, layout: ForestLayout, scale: float, ops: AttentionOps):
    H, N, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, N), dtype=torch.float32, device=q.device)
    buckets = []
    for members, width in layout.self_buckets():
        idx, valid = _bucket_index(layout, members, width, q.device)
        o, l = ops.forward(_gather(q, idx), _gather(k, idx), _gather(v, idx), True, scale)
        flat = idx[valid]
        out[:, flat] = o.permute(1, 0, 2, 3)[:, valid]
        lse[:, flat] = l.permute(1, 0, 2)[:, valid]
        buckets.append((idx, valid))
    for ks, ke, qs, qe in layout.cross_parts():
        o, l = ops.forward(q[None, :, qs:qe], k[None, :, ks:ke], v[None, :, ks:ke], False, scale)
        o, l = o[0], l[0]
        merged = torch.logaddexp(lse[:, qs:qe], l)
        out[:, qs:qe] = (
            out[:, qs:qe].float() * torch.exp(lse[:, qs:qe] - merged)[..., None] + o.float() * torch.exp(l - merged)[..., None]
        ).to(q.dtype)
        lse[:, qs:qe] = merged
    return out, lse, buckets


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, ops):
        out, lse, buckets = _forward(q, k, v, layout, scale, ops)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.ops, ctx.buckets = layout, scale, ops, buckets
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, ops = ctx.layout, ctx.scale, ctx.ops
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for idx, valid in ctx.buckets:
            keep = valid[:, None, :, None]
            g_out = _gather(dout, idx) * keep
            g_lse = _gather(lse[..., None], idx)[..., 0].masked_fill(~valid[:, None, :], _PAD_LSE)
            gq, gk, gv = ops.backward(g_out, _gather(q, idx), _gather(k, idx), _gather(v, idx), _gather(out, idx) * keep, g_lse, True, scale)
            flat = idx[valid]
            dq[:, flat] += gq.permute(1, 0, 2, 3)[:, valid].float()
            dk[:, flat] += gk.permute(1, 0, 2, 3)[:, valid].float()
            dv[:, flat] += gv.permute(1, 0, 2, 3)[:, valid].float()
        for ks, ke, qs, qe in layout.cross_parts():
            gq, gk, gv = ops.backward(
                dout[None, :, qs:qe], q[None, :, qs:qe], k[None, :, ks:ke], v[None, :, ks:ke],
                out[None, :, qs:qe], lse[None, :, qs:qe].contiguous(), False, scale,
            )
            dq[:, qs:qe] += gq[0].float()
            dk[:, ks:ke] += gk[0].float()
            dv[:, ks:ke] += gv[0].float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ForestLayout, scale: float,
                    backend: str = "auto") -> torch.Tensor:
    """q, k, v: [H, N, D] over the packed tokens (K/V already expanded to the query heads); returns [H, N, D]."""
    if q.shape[1] != layout.num_tokens:
        raise ValueError(f"layout covers {layout.num_tokens} tokens but the input has {q.shape[1]}")
    return _SplitAttention.apply(q, k, v, layout, scale, select_ops(backend, q.device))
