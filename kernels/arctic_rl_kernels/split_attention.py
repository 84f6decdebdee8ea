"""Split attention over a prefix forest: each segment's causal self-attention, plus, for every
segment with descendants, one unmasked attention of its whole subtree's queries to its keys,
merged by log-sum-exp.

No key/value is copied per suffix: a prefix's K/V is read once by one call for all of its
descendants, and in backward its gradient is the sum over them. Backward follows the
ring-attention identity: each part's flash backward, fed the *merged* output and LSE, gives
exactly that part's share of dQ, dK, dV.

Families' score rules are part of the definition: a sliding window (by position in the
sequence, so it spans the prefix boundary as in the unshared sequence), an attention-logit
softcap, and attention sinks (one more LSE merge, with a zero value).

Primitives (`AttentionOps`) are swappable: `cpu_flash` uses ATen's CPU flash-attention
kernels, `cuda_flash` ATen's CUDA ones (FlashAttention-2 for 16-bit inputs, the memory-efficient
kernels for fp32: both return the LSE); `math` is matmul-based, tiled over queries, runs on any
device and also applies windows, softcaps and a value head size other than the query's. `triton`
is a `ForestKernel` instead: one fused kernel for the whole forest (`forest_flash_attention.py`),
nothing to merge. K/V may have fewer heads than Q (GQA): the fused kernel reads them through the
head index; the parts' primitives get them repeated. `auto` runs the fastest one measured on the
device model at the forest's length (`backend_timings.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from arctic_rl_kernels import backend_timings
from arctic_rl_kernels.layout import ForestLayout

# Padded query rows get this LSE in backward, so exp(score - lse) == 0 there.
_PAD_LSE = 1e30


@dataclass(frozen=True)
class ScoreMods:
    """What some families do to attention scores beyond `scale * q.k`. Positions are each token's
    position in its sequence, so a window spans the prefix boundary as it would in the unshared sequence."""

    softcap: float | None = None
    """Scores become `softcap * tanh(score / softcap)` (Gemma 2)."""
    window: int | None = None
    """Sliding window: a key is hidden from queries `window` or more positions after it."""

    @property
    def active(self) -> bool:
        return self.softcap is not None or self.window is not None


NO_MODS = ScoreMods()


@dataclass(frozen=True)
class AttentionOps:
    """forward(q, k, v, causal, scale, mods, q_pos, k_pos) -> (out, lse);
    backward(dout, q, k, v, out, lse, causal, scale, mods, q_pos, k_pos) -> (dq, dk, dv), in q's dtype or fp32.
    Tensors are [B, H, L, D]; lse is [B, H, L] in float32; q_pos/k_pos are [L] positions (for windows).
    A row that sees no key gets lse -inf and output 0."""

    name: str
    forward: Callable
    backward: Callable
    supports_mods: bool


def _cpu_flash_forward(q, k, v, causal, scale, mods, q_pos, k_pos):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


# ATen's CPU flash backward in 16 bits is slower than the same backward in fp32, casts included, where a call has few
# keys: 8 heads of 32 on an AVX-512 CPU with bf16, 128 keys 1.2 ms against 0.4 ms, 256 causal 2.0 against 1.3; from
# 512 keys on the 16-bit kernel is as fast or faster (1,024: 11.7 against 17.1 ms). A response's self-attention in a
# GRPO batch is such a call. Its gradients then come back in fp32, which is what the parts accumulate in.
_CPU_FP32_BACKWARD_MAX_KEYS = 256


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mods, q_pos, k_pos):
    if q.dtype != torch.float32 and k.shape[-2] <= _CPU_FP32_BACKWARD_MAX_KEYS:
        dout, q, k, v, out = (x.float() for x in (dout, q, k, v, out))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_forward(q, k, v, causal, scale, mods, q_pos, k_pos):
    if q.dtype == torch.float32:  # ATen's CUDA flash kernels take only 16-bit inputs; the memory-efficient ones fp32
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., : q.shape[-2]]  # its LSE is padded to a multiple of 32 rows
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, mods, q_pos, k_pos):
    # No dropout, so the random state is never read; no sequence bounds (None): dense [B, H, L, D] inputs.
    if q.dtype == torch.float32:
        lse = torch.nn.functional.pad(lse, (0, -q.shape[-2] % 32), value=_PAD_LSE).contiguous()
        unused = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    seed, offset = (torch.zeros(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)


_QUERY_TILE = 1024


def _scores(q, k, causal, scale, mods: ScoreMods, q_pos, k_pos):
    """Modified, masked scores and, with a softcap, d(capped)/d(raw) for backward."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    slope = None
    if mods.softcap is not None:
        t = torch.tanh(s / mods.softcap)
        s, slope = mods.softcap * t, 1 - t * t
    hidden = None
    if causal:
        hidden = k_pos[None, :] > q_pos[:, None]
    if mods.window is not None:
        outside = (q_pos[:, None] - k_pos[None, :]) >= mods.window
        hidden = outside if hidden is None else hidden | outside
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return s, slope


def _positions(pos, n, device):
    return torch.arange(n, device=device) if pos is None else pos


def _math_forward(q, k, v, causal, scale, mods=NO_MODS, q_pos=None, k_pos=None):
    q_pos, k_pos = _positions(q_pos, q.shape[-2], q.device), _positions(k_pos, k.shape[-2], q.device)
    outs, lses = [], []
    for t in range(0, q.shape[-2], _QUERY_TILE):
        s, _ = _scores(q[..., t : t + _QUERY_TILE, :], k, causal, scale, mods, q_pos[t : t + _QUERY_TILE], k_pos)
        lse = torch.logsumexp(s, dim=-1)
        safe = lse.masked_fill(torch.isneginf(lse), 0.0)  # a row that sees nothing: exp(-inf) == 0, not nan
        outs.append((torch.exp(s - safe[..., None]) @ v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _math_backward(dout, q, k, v, out, lse, causal, scale, mods=NO_MODS, q_pos=None, k_pos=None):
    q_pos, k_pos = _positions(q_pos, q.shape[-2], q.device), _positions(k_pos, k.shape[-2], q.device)
    dq = torch.empty_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for t in range(0, q.shape[-2], _QUERY_TILE):
        sl = slice(t, t + _QUERY_TILE)
        qt, dot = q[..., sl, :].float(), dout[..., sl, :].float()
        s, slope = _scores(qt, k, causal, scale, mods, q_pos[sl], k_pos)
        p = torch.exp(s - lse[..., sl, None])
        dv += p.transpose(-1, -2) @ dot
        dp = dot @ v.float().transpose(-1, -2)
        delta = (dot * out[..., sl, :].float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if slope is not None:
            ds = ds * slope
        dq[..., sl, :] = (ds @ k.float()) * scale
        dk += (ds.transpose(-1, -2) @ qt) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dataclass(frozen=True)
class ForestKernel:
    """One fused kernel for the whole forest, windows and softcaps included:
    forward(q, k, v, layout, scale, mods, pos) -> (out, lse);
    backward(dout, q, k, v, out, lse, layout, scale, mods, pos) -> (dq, dk, dv).
    q is [H, N, D], k and v [Hkv, N, D|Dv] with Hkv dividing H; pos is [N] positions or None."""

    name: str
    forward: Callable
    backward: Callable


def _triton_forward(*args):
    # Imported at first use: Triton decides at import whether its kernels run interpreted.
    from arctic_rl_kernels.forest_flash_attention import forest_attention_forward

    return forest_attention_forward(*args)


def _triton_backward(*args):
    from arctic_rl_kernels.forest_flash_attention import forest_attention_backward

    return forest_attention_backward(*args)


CPU_FLASH = AttentionOps("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, supports_mods=False)
CUDA_FLASH = AttentionOps("cuda_flash", _cuda_forward, _cuda_backward, supports_mods=False)
MATH = AttentionOps("math", _math_forward, _math_backward, supports_mods=True)
TRITON = ForestKernel("triton", _triton_forward, _triton_backward)
BACKENDS = {"cpu_flash": CPU_FLASH, "cuda_flash": CUDA_FLASH, "math": MATH, "triton": TRITON}


def _unmeasured_order(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """`auto`'s order on a device without measured timings: the fused kernel (it never materialises scores and
    serves every score rule), then the device's flash primitives, then the tiled math. Not for fp32 on CUDA:
    there the fused kernel multiplies in IEEE fp32 without tensor cores (69x slower than ATen's kernels at 2K
    tokens on an H100, and slower than the tiled math), so it comes last."""
    if device.type == "cuda" and dtype == torch.float32:
        return ("cuda_flash", "math", "triton")
    return ("triton", "cuda_flash", "cpu_flash", "math")


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on any device under its interpreter (TRITON_INTERPRET=1: tests)."""
    try:
        import triton
    except ImportError:
        return False
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def unusable(name: str, device: torch.device, compiled: bool = False) -> str | None:
    """Why backend `name` cannot run on `device`, or None. With `compiled`, Triton's interpreter does not count
    (it is for tests: what `auto` and the bench consider)."""
    if name == "cpu_flash" and device.type != "cpu":
        return f"runs ATen's CPU kernels; this is {device.type}"
    if name == "cuda_flash" and device.type != "cuda":
        return f"runs ATen's CUDA kernels; this is {device.type}"
    if name == "triton" and not triton_usable(device):
        return f"needs Triton and a CUDA device (or TRITON_INTERPRET=1); this is {device.type}"
    if name == "triton" and compiled and device.type != "cuda":
        return f"runs only interpreted on {device.type}"
    return None


def _serves(ops: AttentionOps | ForestKernel, mods: ScoreMods, equal_head_dims: bool) -> bool:
    # Flash primitives take no score modification and one head size for Q, K and V.
    return isinstance(ops, ForestKernel) or ops.supports_mods or (not mods.active and equal_head_dims)


def auto_backend(device: torch.device, dtype: torch.dtype, mods: ScoreMods = NO_MODS, equal_head_dims: bool = True,
                 head_dim: int = 128, longest: int = 2048) -> str:
    """The fastest backend measured on this device model and dtype (`backend_timings`) at the length nearest
    `longest` (the longest sequence of the forest), among those that run here and serve these score rules;
    without timings, the first of `_unmeasured_order` that does. Triton counts only compiled: the interpreter
    is for tests."""
    candidates = [name for name in _unmeasured_order(device, dtype)
                  if unusable(name, device, compiled=True) is None and _serves(BACKENDS[name], mods, equal_head_dims)]
    return backend_timings.fastest(device, dtype, candidates, head_dim, longest) or candidates[0]


def select_ops(name: str, device: torch.device, dtype: torch.dtype = torch.float32, mods: ScoreMods = NO_MODS,
               equal_head_dims: bool = True, head_dim: int = 128, longest: int = 2048) -> AttentionOps | ForestKernel:
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown split-attention backend {name!r}; choose auto, {', '.join(BACKENDS)}")
    if name == "auto":
        name = auto_backend(device, dtype, mods, equal_head_dims, head_dim, longest)
    reason = unusable(name, device)
    if reason is not None:
        raise ValueError(f"the {name} split-attention backend {reason}")
    ops = BACKENDS[name]
    # Layers with windows, softcaps or a different value head size (multi-latent attention) run the math
    # primitives where the chosen ones cannot.
    return ops if _serves(ops, mods, equal_head_dims) else MATH


# On a CPU, a segment this long gets its own call on views of the packed tensors: no copy, and ATen's per-call cost
# (about 15 us) is small beside its work. Shorter ones are batched by length, gathered, as per-call costs would
# dominate them (measured on a 2-core EPYC, 8 heads of 32: 64 segments of 8 tokens 0.4 ms batched, 1.0 ms one by
# one; of 64 tokens even; of 128, 7% faster one by one, and a 1K-token prompt's gather is pure loss). On a GPU every
# segment is batched: one call of a short segment's few heads would leave most of the SMs idle.
_OWN_CALL_MIN_TOKENS = 64


@dataclass(frozen=True)
class _Bucket:
    """Short segments of similar length, padded to `width` and attended as one batch of `n` rows."""

    gather: torch.Tensor
    """[n * width] packed index of each row's tokens (0 in padding: a real token, masked wherever it matters)."""
    valid: torch.Tensor
    """[n, width] which of those are the segments' own tokens."""
    rows: torch.Tensor
    """[tokens] where the segments' own tokens lie in the flattened [n * width] batch."""
    packed: torch.Tensor
    """[tokens] their packed indices, in the same order."""
    n: int
    width: int


def _self_parts(layout: ForestLayout, device) -> tuple[list[tuple[int, int]], list[_Bucket]]:
    """Every segment's causal self-attention: on a CPU the long segments' (start, end), and buckets of the rest.
    Built once per layout and device (every layer's forward and backward reads them)."""
    key = ("self", str(device))
    if key in layout._tables:
        return layout._tables[key]
    own_call_min = _OWN_CALL_MIN_TOKENS if torch.device(device).type == "cpu" else layout.num_tokens + 1
    own, buckets = [], []
    for members, _ in layout.self_buckets():
        lengths = {seg: layout.ends[seg] - layout.starts[seg] for seg in members}
        own += [(layout.starts[seg], layout.ends[seg]) for seg in members if lengths[seg] >= own_call_min]
        short = [seg for seg in members if lengths[seg] < own_call_min]
        if not short:
            continue
        width = max(lengths[seg] for seg in short)
        gather = torch.zeros((len(short), width), dtype=torch.long)
        valid = torch.zeros((len(short), width), dtype=torch.bool)
        for row, seg in enumerate(short):
            gather[row, : lengths[seg]] = torch.arange(layout.starts[seg], layout.ends[seg])
            valid[row, : lengths[seg]] = True
        rows = valid.flatten().nonzero()[:, 0]
        buckets.append(_Bucket(gather.flatten().to(device), valid.to(device), rows.to(device),
                               gather.flatten()[rows].to(device), len(short), width))
    layout._tables[key] = own, buckets
    return own, buckets


def _gather(x: torch.Tensor, bucket: _Bucket) -> torch.Tensor:
    """[H, N, D] -> [n, H, width, D]: one contiguous copy of whole rows (index_select, not advanced indexing)."""
    return x.index_select(1, bucket.gather).view(x.shape[0], bucket.n, bucket.width, *x.shape[2:]).transpose(0, 1)


def _scatter(dst: torch.Tensor, bucket: _Bucket, batched: torch.Tensor) -> None:
    """Writes a bucket's [n, H, width, ...] result for its segments' own tokens into packed [H, N, ...] `dst`."""
    flat = batched.transpose(0, 1).reshape(dst.shape[0], bucket.n * bucket.width, *dst.shape[2:])
    dst.index_copy_(1, bucket.packed, flat.index_select(1, bucket.rows).to(dst.dtype))


def _cross_parts(layout: ForestLayout, mods: ScoreMods, pos: torch.Tensor | None):
    """(key_start, key_end, query_start, query_end, query positions, key positions) of every part some query sees."""
    for ks, ke, qs, qe in layout.cross_parts():
        if mods.window is None:
            yield ks, ke, qs, qe, None, None
            continue
        q_pos, k_pos = pos[qs:qe], pos[ks:ke]
        if int(q_pos.min()) - int(k_pos.max()) < mods.window:  # else the window hides the whole prefix
            yield ks, ke, qs, qe, q_pos, k_pos


def _forward_parts(q, k, v, layout: ForestLayout, scale: float, ops: AttentionOps, mods: ScoreMods, pos):
    H, N, _ = q.shape
    out = q.new_empty((H, N, v.shape[-1]))
    lse = torch.empty((H, N), dtype=torch.float32, device=q.device)
    own, buckets = _self_parts(layout, q.device)
    # Within a segment, positions differ as local indices do: the default positions serve.
    for s, e in own:
        o, l = ops.forward(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], True, scale, mods, None, None)
        out[:, s:e], lse[:, s:e] = o[0], l[0]
    for bucket in buckets:
        o, l = ops.forward(_gather(q, bucket), _gather(k, bucket), _gather(v, bucket), True, scale, mods, None, None)
        _scatter(out, bucket, o)
        _scatter(lse, bucket, l)
    for ks, ke, qs, qe, q_pos, k_pos in _cross_parts(layout, mods, pos):
        o, l = ops.forward(q[None, :, qs:qe], k[None, :, ks:ke], v[None, :, ks:ke], False, scale, mods, q_pos, k_pos)
        o, l = o[0], l[0]
        merged = torch.logaddexp(lse[:, qs:qe], l)
        out[:, qs:qe] = (
            out[:, qs:qe].float() * torch.exp(lse[:, qs:qe] - merged)[..., None] + o.float() * torch.exp(l - merged)[..., None]
        ).to(q.dtype)
        lse[:, qs:qe] = merged
    return out, lse


def _backward_parts(dout, q, k, v, out, lse, layout: ForestLayout, scale: float, ops: AttentionOps, mods: ScoreMods,
                    pos):
    # Every part's backward is fed the merged output and LSE (sink included): that gives its exact share. The self
    # parts cover every token once, so they write the gradients; the cross parts then add theirs.
    dq = torch.empty_like(q, dtype=torch.float32)
    dk = torch.empty_like(k, dtype=torch.float32)
    dv = torch.empty_like(v, dtype=torch.float32)
    own, buckets = _self_parts(layout, q.device)
    for s, e in own:
        gq, gk, gv = ops.backward(dout[None, :, s:e], q[None, :, s:e], k[None, :, s:e], v[None, :, s:e],
                                  out[None, :, s:e], lse[None, :, s:e].contiguous(), True, scale, mods, None, None)
        dq[:, s:e], dk[:, s:e], dv[:, s:e] = gq[0], gk[0], gv[0]
    for bucket in buckets:
        keep = bucket.valid[:, None, :, None]
        g_lse = _gather(lse, bucket).masked_fill(~bucket.valid[:, None, :], _PAD_LSE)
        gq, gk, gv = ops.backward(_gather(dout, bucket) * keep, _gather(q, bucket), _gather(k, bucket),
                                  _gather(v, bucket), _gather(out, bucket) * keep, g_lse, True, scale, mods, None, None)
        for grad, part in ((dq, gq), (dk, gk), (dv, gv)):
            _scatter(grad, bucket, part)
    for ks, ke, qs, qe, q_pos, k_pos in _cross_parts(layout, mods, pos):
        gq, gk, gv = ops.backward(
            dout[None, :, qs:qe], q[None, :, qs:qe], k[None, :, ks:ke], v[None, :, ks:ke],
            out[None, :, qs:qe], lse[None, :, qs:qe].contiguous(), False, scale, mods, q_pos, k_pos,
        )
        dq[:, qs:qe] += gq[0].float()
        dk[:, ks:ke] += gk[0].float()
        dv[:, ks:ke] += gv[0].float()
    return dq, dk, dv


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


def _sum_heads(dx: torch.Tensor, groups: int) -> torch.Tensor:
    return dx if groups == 1 else dx.view(dx.shape[0] // groups, groups, *dx.shape[1:]).sum(1)


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, scale, ops, mods):
        pos = layout.positions(q.device) if mods.window is not None else None
        groups = q.shape[0] // k.shape[0]
        if isinstance(ops, ForestKernel):
            out, lse = ops.forward(q, k, v, layout, scale, mods, pos)
        else:
            # The parts' primitives take K/V per query head: repeated once here, and kept for backward.
            k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
            out, lse = _forward_parts(q, k, v, layout, scale, ops, mods, pos)
        if sinks is not None:
            # A sink is one more logit per head in every row's softmax, with a zero value: one more LSE merge.
            merged = torch.logaddexp(lse, sinks.float()[:, None])
            out = (out.float() * torch.exp(lse - merged)[..., None]).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout, ctx.scale, ctx.ops, ctx.mods, ctx.pos = layout, scale, ops, mods, pos
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, scale, ops, mods, pos = ctx.layout, ctx.scale, ctx.ops, ctx.mods, ctx.pos
        dout = dout.contiguous()
        if isinstance(ops, ForestKernel):
            dq, dk, dv = ops.backward(dout, q, k, v, out, lse, layout, scale, mods, pos)
        else:
            dq, dk, dv = _backward_parts(dout, q, k, v, out, lse, layout, scale, ops, mods, pos)
            dk, dv = _sum_heads(dk, ctx.groups), _sum_heads(dv, ctx.groups)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d lse_total / d sink = p_sink; the sink's value is 0, so dL/dsink = -sum_rows p_sink * (dout . out).
            delta = (dout.float() * out.float()).sum(-1)
            dsinks = (-(torch.exp(sinks.float()[:, None] - lse) * delta).sum(-1)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ForestLayout, scale: float,
                    backend: str = "auto", *, softcap: float | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [H, N, D], k: [Hkv, N, D] and v: [Hkv, N, Dv] over the packed tokens, Hkv dividing H (GQA: query
    head h reads K/V head h // (H // Hkv)); returns [H, N, Dv].

    `softcap` and `window` modify scores as `ScoreMods` says; `sinks` ([H], GPT-OSS) adds one logit per
    head to every row's softmax denominator. A window no shorter than the longest sequence is plain causal."""
    if q.shape[1] != layout.num_tokens:
        raise ValueError(f"layout covers {layout.num_tokens} tokens but the input has {q.shape[1]}")
    if window is not None and window <= 0:
        raise ValueError(f"a sliding window must be positive, got {window}")
    if window is not None and window > int(layout.positions().max()):
        window = None
    if k.shape[0] != v.shape[0] or q.shape[0] % k.shape[0]:
        raise ValueError(f"key/value heads ({k.shape[0]}, {v.shape[0]}) must be equal and divide the query heads ({q.shape[0]})")
    if sinks is not None and sinks.shape != (q.shape[0],):
        raise ValueError(f"sinks must hold one logit per head ({q.shape[0]}), got shape {tuple(sinks.shape)}")
    mods = ScoreMods(softcap=softcap, window=window)
    ops = select_ops(backend, q.device, q.dtype, mods, equal_head_dims=v.shape[-1] == q.shape[-1], head_dim=q.shape[-1],
                     longest=layout.longest)
    return _SplitAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, layout, scale, ops, mods)
