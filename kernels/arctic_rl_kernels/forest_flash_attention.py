"""Flash attention over a packed prefix forest in Triton: the whole forest mask in one fused kernel.

The split path (`split_attention.py`) computes a forest as parts — each segment's causal
self-attention, then each prefix's attention to its subtree — and merges them by log-sum-exp.
Here one kernel does it: a query tile (never crossing a segment) walks the key ranges it sees
(`ForestLayout.query_tiles`: its ancestors whole, then its own segment up to the tile), so a
prefix's K/V is read for its descendants' queries and never copied per suffix, scores never leave
registers, and there is nothing to merge. Backward is FlashAttention-2's: a key tile's dK, dV come
from the one query range that sees it (`ForestLayout.key_tiles`), so no atomics for them; dQ either
walks the forward's ranges again (`_dq_kernel`: deterministic, but scores and probabilities computed
twice) or is added by fp32 atomics in the same pass (ATOMIC_DQ: five matrix products per tile pair, not
seven); which one is a tile setting, timed per device (`arctic-rl bench attention --tune`). Tiles every
query sees whole (a prefix's keys, keys left of the diagonal) skip the mask; scores are in base 2 inside.

GQA is read through the head index (a query head reads K/V head `h // groups`): repeated K/V are never
materialised, and a KV head's program sums dK, dV over its query heads. Windows and softcaps are score
rules inside the kernel; with a window, the keys (forward, dQ) and query blocks (dK, dV) it hides from a
whole tile are skipped, so a windowed layer costs about its window per query, not its whole prefix. The
sink merge stays outside (`split_attention`). Scores, softmax and
accumulators are fp32 for every input dtype; fp32 inputs multiply in IEEE fp32 (no TF32).

Without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module
is imported): how the parity tests run in `make test`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arctic_rl_kernels import backend_timings
from arctic_rl_kernels.layout import ForestLayout
from arctic_rl_kernels.triton_device import check_device, interpreted, on_device


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter multiplies bf16/fp16 operands wrongly; they are exact in fp32, as in a tensor core's
    # fp32-accumulated product, so under the interpreter they are multiplied as fp32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): inside the kernels scores are in base 2 (exp2 is the GPU's native exponential); the LSE leaves and
enters them in natural units."""


@triton.jit
def _scores(q, k, offs_m, offs_n, n_end, pos_ptr, scale, softcap, window, MASKED: tl.constexpr,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of a query tile against a key tile in base 2 (natural scores times log2 e), and d(capped)/d(raw)
    for backward. MASKED applies the forest's rule inside a key range (`k <= q`, keys before `n_end`) and the
    window; a tile every query sees whole skips it (`_whole_keys_end`, `_whole_queries_end`)."""
    raw = _dot(q, tl.trans(k), PRECISION, UPCAST)
    slope = raw
    if SOFTCAP:
        t = _tanh(raw * scale / softcap)
        s = (softcap * LOG2E) * t
        slope = 1 - t * t
    else:
        s = raw * (scale * LOG2E)
    if MASKED:
        visible = (offs_n[None, :] < n_end) & (offs_n[None, :] <= offs_m[:, None])
        if WINDOW:
            q_pos = tl.load(pos_ptr + offs_m)
            k_pos = tl.load(pos_ptr + offs_n, mask=offs_n < n_end, other=0)
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
    return s, slope


@triton.jit
def _query_tile(Q, stride_qh, h, tile, q_start_ptr, q_end_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A query tile's token indices, which of its rows are real, and its queries of head h."""
    q0, q1 = tl.load(q_start_ptr + tile), tl.load(q_end_ptr + tile)
    offs_m = q0 + tl.arange(0, BLOCK_M)
    rows = offs_m < q1
    offs_m = tl.where(rows, offs_m, q0)  # padded rows repeat the first query: same ranges, no out-of-bounds
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + h * stride_qh + offs_m[:, None] * D + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    return offs_m, rows, q


@triton.jit
def _key_tile(K, V, kv, stride_kh, stride_vh, n0, n_end, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The keys and values of KV head kv at token indices n0 + [0, BLOCK_N), zero past n_end."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    keys = offs_n < n_end
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = tl.load(K + kv * stride_kh + offs_n[:, None] * D + offs_d[None, :], mask=keys[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + kv * stride_vh + offs_n[:, None] * DV + offs_dv[None, :], mask=keys[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return offs_n, k, v


@triton.jit
def _first_visible(POS, k0, k1, q_first, window, WINDOW: tl.constexpr):
    """The first key of range [k0, k1) the window lets a tile's earliest query (q_first) see. Positions run
    consecutively within a range and within a tile, so every key before it is hidden from the whole tile and
    is skipped, not just masked: a windowed layer reads about `window` keys per query, not the whole prefix."""
    if WINDOW:
        hidden = (tl.load(POS + q_first) - window + 1 - tl.load(POS + k0)).to(tl.int32)
        return tl.minimum(k1, k0 + tl.maximum(hidden, 0))
    return k0


@triton.jit
def _whole_keys_end(start, k1, q_first, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Where a query tile's whole key tiles of range [start, k1) end: tiles of keys all before k1 and at or
    before the tile's first query, which every query of the tile sees (a prefix's keys, and its own segment's
    keys left of the diagonal); those skip the mask. With a window every tile is masked."""
    if WINDOW:
        return start
    return start + tl.maximum(tl.minimum(k1, q_first + 1) - start, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _forward_step(q, m_i, l_i, acc, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS, scale, softcap, window,
                  MASKED: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the online softmax, in base 2."""
    offs_n, k, v = _key_tile(K, V, kv, stride_kh, stride_vh, n0, k1, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    s, _ = _scores(q, k, offs_m, offs_n, k1, POS, scale, softcap, window, MASKED, SOFTCAP, WINDOW, PRECISION, UPCAST)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _forward_kernel(Q, K, V, O, LSE, POS, q_start_ptr, q_end_ptr, range_ptr, k_start_ptr, k_end_ptr,
                    stride_qh, stride_kh, stride_vh, stride_oh, N, scale, softcap, window,
                    GROUPS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: a long pack's heads pass 2**31 elements
    kv = h // GROUPS
    offs_m, rows, q = _query_tile(Q, stride_qh, h, tile, q_start_ptr, q_end_ptr, D, BLOCK_M, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    q_first = tl.load(q_start_ptr + tile)
    for r in range(tl.load(range_ptr + tile), tl.load(range_ptr + tile + 1)):
        k0, k1 = tl.load(k_start_ptr + r), tl.load(k_end_ptr + r)
        start = _first_visible(POS, k0, k1, q_first, window, WINDOW)
        whole_end = _whole_keys_end(start, k1, q_first, BLOCK_N, WINDOW)
        if not WINDOW:  # (compiled only where there are whole tiles: fewer registers for windowed layers)
            for n0 in range(start, whole_end, BLOCK_N):
                m_i, l_i, acc = _forward_step(q, m_i, l_i, acc, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS,
                                              scale, softcap, window, False, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP,
                                              WINDOW, PRECISION, UPCAST)
        for n0 in range(whole_end, k1, BLOCK_N):
            m_i, l_i, acc = _forward_step(q, m_i, l_i, acc, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS, scale,
                                          softcap, window, True, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, WINDOW,
                                          PRECISION, UPCAST)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    tl.store(O + h * stride_oh + offs_m[:, None] * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + h * N + offs_m, lse, mask=rows)


@triton.jit
def _within_window(POS, offs_m, rows, n1, window, WINDOW: tl.constexpr):
    """Whether a block of queries may see a key tile ending at n1: with a window, not when even its earliest query
    is `window` positions past the tile's last key (sibling subtrees restart positions, so each block is asked)."""
    if WINDOW:
        earliest = tl.min(tl.where(rows, tl.load(POS + offs_m), 2**62))
        return earliest - tl.load(POS + n1 - 1) < window
    return True


@triton.jit
def _dkdv_block(Q, DO, LSE, DELTA, DQ_ACC, POS, k, v, dk, dv, h, m0, q_end, n0, offs_n, n1, stride_qh, stride_oh, N,
                scale, softcap, window, MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One query block's share of a key tile's dK and dV (and with ATOMIC_DQ, the key tile's share of the block's
    dQ, added in place). Unmasked, every query of the block is real and sees every key of the tile; a key tile
    ending early (at its segment's end) then still holds zero keys and values past n1, which add nothing to dQ,
    and its rows of dK, dV past n1 are never stored."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = offs_m < q_end
    if MASKED:
        offs_m = tl.where(rows, offs_m, n0)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    if _within_window(POS, offs_m, rows, n1, window, WINDOW):
        q = tl.load(Q + h * stride_qh + offs_m[:, None] * D + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
        do = tl.load(DO + h * stride_oh + offs_m[:, None] * DV + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
        lse = tl.load(LSE + h * N + offs_m) * LOG2E
        delta = tl.load(DELTA + h * N + offs_m)
        s, slope = _scores(q, k, offs_m, offs_n, n1, POS, scale, softcap, window, MASKED, SOFTCAP, WINDOW,
                           PRECISION, UPCAST)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(rows[:, None], p, 0.0)
        dv += _dot(tl.trans(p).to(do.dtype), do, PRECISION, UPCAST)
        ds = p * (_dot(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
        if SOFTCAP:
            ds = ds * slope
        dk += _dot(tl.trans(ds).to(q.dtype), q, PRECISION, UPCAST)
        if ATOMIC_DQ:
            dq = _dot(ds.to(k.dtype), k, PRECISION, UPCAST) * scale
            tl.atomic_add(DQ_ACC + h * stride_qh + offs_m[:, None] * D + offs_d[None, :], dq,
                          mask=rows[:, None] & (offs_d[None, :] < D), sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_OUT, DQ_ACC, POS, k_start_ptr, k_end_ptr, q_end_ptr,
                 stride_qh, stride_kh, stride_vh, stride_oh, N, scale, softcap, window,
                 GROUPS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A key tile's dK, dV from the query range that sees it, in three runs of query blocks: those overlapping
    the tile's own keys (causal, masked), the whole ones after (unmasked), the last partial one (masked). With
    ATOMIC_DQ the same pass adds each block's dQ (FlashAttention-2's one-pass backward, dQ by fp32 atomics):
    scores and probabilities are computed once, not again in `_dq_kernel`."""
    tile, kv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n0, n1, q_end = tl.load(k_start_ptr + tile), tl.load(k_end_ptr + tile), tl.load(q_end_ptr + tile)
    offs_n, k, v = _key_tile(K, V, kv, stride_kh, stride_vh, n0, n1, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    keys = offs_n < n1
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if WINDOW:  # every block masked (and skipped where the window hides the tile from it)
        whole_end = n0
    else:
        diagonal_end = tl.minimum(n0 + tl.cdiv(n1 - n0, BLOCK_M) * BLOCK_M, q_end)
        whole_end = diagonal_end + (q_end - diagonal_end) // BLOCK_M * BLOCK_M
    for g in range(GROUPS):
        h = kv * GROUPS + g
        if not WINDOW:  # (compiled only where there are whole blocks: fewer registers for windowed layers)
            for m0 in range(n0, diagonal_end, BLOCK_M):
                dk, dv = _dkdv_block(Q, DO, LSE, DELTA, DQ_ACC, POS, k, v, dk, dv, h, m0, q_end, n0, offs_n, n1,
                                     stride_qh, stride_oh, N, scale, softcap, window, True, ATOMIC_DQ, D, DV, BLOCK_D,
                                     BLOCK_DV, BLOCK_M, SOFTCAP, WINDOW, PRECISION, UPCAST)
            for m0 in range(diagonal_end, whole_end, BLOCK_M):
                dk, dv = _dkdv_block(Q, DO, LSE, DELTA, DQ_ACC, POS, k, v, dk, dv, h, m0, q_end, n0, offs_n, n1,
                                     stride_qh, stride_oh, N, scale, softcap, window, False, ATOMIC_DQ, D, DV, BLOCK_D,
                                     BLOCK_DV, BLOCK_M, SOFTCAP, WINDOW, PRECISION, UPCAST)
        for m0 in range(whole_end, q_end, BLOCK_M):
            dk, dv = _dkdv_block(Q, DO, LSE, DELTA, DQ_ACC, POS, k, v, dk, dv, h, m0, q_end, n0, offs_n, n1, stride_qh,
                                 stride_oh, N, scale, softcap, window, True, ATOMIC_DQ, D, DV, BLOCK_D, BLOCK_DV,
                                 BLOCK_M, SOFTCAP, WINDOW, PRECISION, UPCAST)
    tl.store(DK + kv * stride_kh + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=keys[:, None] & (offs_d[None, :] < D))
    tl.store(DV_OUT + kv * stride_vh + offs_n[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=keys[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_step(q, do, lse, delta, dq, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS, scale, softcap, window,
             MASKED: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    offs_n, k, v = _key_tile(K, V, kv, stride_kh, stride_vh, n0, k1, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    s, slope = _scores(q, k, offs_m, offs_n, k1, POS, scale, softcap, window, MASKED, SOFTCAP, WINDOW, PRECISION, UPCAST)
    p = tl.exp2(s - lse[:, None])
    ds = p * (_dot(do, tl.trans(v), PRECISION, UPCAST) - delta[:, None])
    if SOFTCAP:
        ds = ds * slope
    return dq + _dot(ds.to(k.dtype), k, PRECISION, UPCAST)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, POS, q_start_ptr, q_end_ptr, range_ptr, k_start_ptr, k_end_ptr,
               stride_qh, stride_kh, stride_vh, stride_oh, N, scale, softcap, window,
               GROUPS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    kv = h // GROUPS
    offs_m, rows, q = _query_tile(Q, stride_qh, h, tile, q_start_ptr, q_end_ptr, D, BLOCK_M, BLOCK_D)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    do = tl.load(DO + h * stride_oh + offs_m[:, None] * DV + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
    lse = tl.load(LSE + h * N + offs_m) * LOG2E
    delta = tl.load(DELTA + h * N + offs_m)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_first = tl.load(q_start_ptr + tile)
    for r in range(tl.load(range_ptr + tile), tl.load(range_ptr + tile + 1)):
        k0, k1 = tl.load(k_start_ptr + r), tl.load(k_end_ptr + r)
        start = _first_visible(POS, k0, k1, q_first, window, WINDOW)
        whole_end = _whole_keys_end(start, k1, q_first, BLOCK_N, WINDOW)
        if not WINDOW:
            for n0 in range(start, whole_end, BLOCK_N):
                dq = _dq_step(q, do, lse, delta, dq, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS, scale,
                              softcap, window, False, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, WINDOW, PRECISION,
                              UPCAST)
        for n0 in range(whole_end, k1, BLOCK_N):
            dq = _dq_step(q, do, lse, delta, dq, K, V, kv, stride_kh, stride_vh, n0, k1, offs_m, POS, scale, softcap,
                          window, True, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, SOFTCAP, WINDOW, PRECISION, UPCAST)
    tl.store(DQ + h * stride_qh + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows[:, None] & (offs_d[None, :] < D))


KERNELS = ("forward", "dkdv", "dq")
"""The fused kernel's three kernels; each takes its own tiles (BLOCK_M queries x BLOCK_N keys, warps, stages).
dK/dV's may also say ATOMIC_DQ: True, the one-pass backward, where `dq`'s tiles go unused."""


def default_tiles(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, dict]:
    """Tiles for a device with none tuned (`arctic-rl bench attention --tune`). Small tiles under the interpreter
    keep tests fast; on a GPU 64x64, FlashAttention-2's tile for head sizes <= 128, in two pipeline stages for
    fp32 (twice the shared memory per stage), three for 16-bit. Each is checked for Hopper without a GPU
    (tests/test_kernel_compile.py: at most 227 KiB of shared memory, no register spills in 16-bit): dK/dV holds
    two fp32 accumulators and the K, V tile in registers, so it takes 32 queries at a time on 8 warps (64 on 4
    spills); head sizes past 128 take smaller tiles in every kernel and dtype (64x64 spills in 16-bit and needs
    272 KiB of shared memory in fp32's backward; dQ's 32x32 on 4 warps spills neither with softcap and window nor
    without). dQ by atomics (ATOMIC_DQ) stays off until `--tune` times it faster on the device."""
    def tile(m, n, warps, stages):
        return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}

    if device.type != "cuda":
        return {kernel: tile(16, 16, 4, 1) for kernel in KERNELS}
    if head_dim > 128:
        return {"forward": tile(64, 32, 8, 2), "dkdv": tile(16, 32, 8, 2), "dq": tile(32, 32, 4, 2)}
    if dtype == torch.float32:
        return {kernel: tile(64, 64, 4, 2) for kernel in KERNELS}
    return {"forward": tile(64, 64, 4, 3), "dkdv": tile(32, 64, 8, 3), "dq": tile(64, 64, 4, 3)}


def tiles_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, dict]:
    """The tiles the kernels run with: tuned for this device model, dtype and head size where recorded (fp16 and
    bf16 share tiles: the same element size), else `default_tiles`."""
    if device.type == "cuda" and not interpreted(_forward_kernel):
        for candidate in (dtype, *{torch.bfloat16: [torch.float16], torch.float16: [torch.bfloat16]}.get(dtype, [])):
            tuned = backend_timings.tuned_tiles(device, candidate, head_dim)
            if tuned is not None:
                return tuned
    return default_tiles(device, dtype, head_dim)


def _settings(q, k, v, mods, pos, tiles):
    H, N, D = q.shape
    Hkv, DV = k.shape[0], v.shape[-1]
    check_device(q.device, _forward_kernel, "split attention")
    tiles = tiles or tiles_for(q.device, q.dtype, max(D, DV))
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    return dict(
        GROUPS=H // Hkv, D=D, DV=DV, BLOCK_D=block_d, BLOCK_DV=block_dv,
        SOFTCAP=mods.softcap is not None, WINDOW=mods.window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreted(_forward_kernel) and q.dtype != torch.float32,
    ), tiles, (pos if pos is not None else q.new_zeros(1, dtype=torch.long)), (mods.softcap or 1.0), (mods.window or 0)


def forest_attention_forward(q, k, v, layout: ForestLayout, scale: float, mods, pos, tiles: dict | None = None):
    """q [H, N, D], k [Hkv, N, D], v [Hkv, N, DV] (contiguous) -> (out [H, N, DV] in q's dtype, lse [H, N] fp32).
    `tiles` overrides the configured ones (`tiles_for`): how `--tune` tries others."""
    meta, tiles, pos, softcap, window = _settings(q, k, v, mods, pos, tiles)
    H, N, _ = q.shape
    fwd = tiles["forward"]
    query_tiles = layout.query_tiles(fwd["BLOCK_M"], q.device)
    out = q.new_empty((H, N, meta["DV"]))
    lse = torch.empty((H, N), dtype=torch.float32, device=q.device)
    with on_device(q.device):
        _forward_kernel[(len(query_tiles[0]), H)](q, k, v, out, lse, pos, *query_tiles, q.stride(0), k.stride(0),
                                                  v.stride(0), out.stride(0), N, scale, softcap, window, **meta, **fwd)
    return out, lse


def forest_attention_backward(dout, q, k, v, out, lse, layout: ForestLayout, scale: float, mods, pos,
                              tiles: dict | None = None):
    """Gradients given the output and LSE the loss saw (with sinks merged in, if any): (dq, dk, dv)."""
    meta, tiles, pos, softcap, window = _settings(q, k, v, mods, pos, tiles)
    H, N, _ = q.shape
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # FlashAttention-2's rowsum(dO * O)
    lse = lse.contiguous()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkdv = {"ATOMIC_DQ": False, **tiles["dkdv"]}
    if torch.are_deterministic_algorithms_enabled():  # atomics sum dQ in whatever order the blocks run
        dkdv["ATOMIC_DQ"] = False
    # With ATOMIC_DQ the dK/dV pass adds dQ into an fp32 buffer; else `_dq_kernel` walks the queries' key ranges.
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dkdv["ATOMIC_DQ"] else delta
    key_tiles = layout.key_tiles(dkdv["BLOCK_N"], q.device)
    with on_device(q.device):
        _dkdv_kernel[(len(key_tiles[0]), k.shape[0])](q, k, v, dout, lse, delta, dk, dv, dq_acc, pos, *key_tiles,
                                                       q.stride(0), k.stride(0), v.stride(0), dout.stride(0), N, scale,
                                                       softcap, window, **meta, **dkdv)
        if dkdv["ATOMIC_DQ"]:
            return dq_acc.to(q.dtype), dk, dv
        dq, dq_tiles = torch.empty_like(q), tiles["dq"]
        query_tiles = layout.query_tiles(dq_tiles["BLOCK_M"], q.device)
        _dq_kernel[(len(query_tiles[0]), H)](q, k, v, dout, lse, delta, dq, pos, *query_tiles, q.stride(0), k.stride(0),
                                             v.stride(0), dout.stride(0), N, scale, softcap, window, **meta, **dq_tiles)
    return dq, dk, dv
