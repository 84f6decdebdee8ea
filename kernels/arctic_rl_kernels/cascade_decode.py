"""Forest cascade attention for decoding: each sequence's one new query token attends to its KV cache,
a chain of segments (shared prefixes, root to leaf, then its own suffix) in one packed cache.

A shared segment's K/V is read once for all the sequences that read it: one work item stacks the
query heads of every reader of one KV head as the rows of one tile (GQA without repeating K/V), as
FlashInfer's shared-prefix cascade decode does. Long segments are split into key chunks (split-K, as
in flash-decoding) so a 32K prompt has parallelism. Each (item, KV head) program writes a partial
output and log-sum-exp per reader; partials are merged per sequence by LSE.

`DecodeForest.unshared()` is the baseline with the same kernel: every sequence reads its own copy of
each range, as plain paged decoding does. `DecodeForest.from_block_tables` finds the forest of a paged
cache (vLLM's layout): sequences whose block tables start with the same physical blocks, as a prefix
cache lays out a group's prompt, share them; keys are then read through their cache rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from arctic_rl_kernels.triton_device import check_device, interpreted, on_device

CHUNK = 512
"""Keys per work item: a 32K prompt becomes 64 items per KV head."""
ROWS = 64
"""Query rows per tile by default: readers per work item are ROWS // (H // Hkv); a segment read by more
sequences is read once per block of that many."""


@dataclass(frozen=True)
class DecodePlan:
    """The work items of one forest, as tensors on one device (int32 for the kernel).

    Item i covers keys [k0[i], k1[i]) of one segment for the sequences readers[i] (-1 padded);
    reader j of item i writes its partial to slot slots[i, j]. slot_seq[s] is slot s's sequence
    (int64, for the merge's index ops)."""

    k0: torch.Tensor
    k1: torch.Tensor
    readers: torch.Tensor
    slots: torch.Tensor
    slot_seq: torch.Tensor
    block_r: int
    key_rows: torch.Tensor | None = None
    """int32 cache row of each logical key (a paged forest's), else None."""

    @property
    def keys_read(self) -> int:
        """Keys the items read per KV head: a key is read once per item covering it."""
        return int((self.k1 - self.k0).sum())


@dataclass(frozen=True)
class DecodeForest:
    """Which ranges of a packed KV cache each decoding sequence reads."""

    segments: tuple[tuple[int, int], ...]
    """(start, end) of each segment in the packed cache. Ranges may alias: `unshared()` gives every
    reader its own copy of a range."""
    chains: tuple[tuple[int, ...], ...]
    """Per sequence, the ids of the segments it reads, root to leaf."""
    key_rows: tuple[int, ...] | None = None
    """A paged cache's row of each key index the segments name (`from_block_tables`); None: the rows themselves."""

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple((int(s), int(e)) for s, e in self.segments))
        object.__setattr__(self, "chains", tuple(tuple(int(i) for i in chain) for chain in self.chains))
        for i, (s, e) in enumerate(self.segments):
            if not 0 <= s < e:
                raise ValueError(f"segments[{i}] = ({s}, {e}): a segment needs 0 <= start < end")
        if not self.chains:
            raise ValueError("chains: a forest needs at least one sequence")
        for b, chain in enumerate(self.chains):
            if not chain:
                raise ValueError(f"chains[{b}] is empty: every sequence reads at least one segment")
            if any(not 0 <= i < len(self.segments) for i in chain):
                raise ValueError(f"chains[{b}] = {chain}: segment ids must be in [0, {len(self.segments)})")
            if len(set(chain)) != len(chain):
                raise ValueError(f"chains[{b}] = {chain} reads a segment twice")
            ranges = sorted(self.segments[i] for i in chain)
            if any(prev[1] > nxt[0] for prev, nxt in zip(ranges, ranges[1:])):
                raise ValueError(f"chains[{b}] = {chain}: its segments' ranges overlap, so it would read a key twice")
        if self.key_rows is not None:
            object.__setattr__(self, "key_rows", tuple(map(int, self.key_rows)))
            if len(self.key_rows) < self.num_tokens or min(self.key_rows) < 0:
                raise ValueError(f"key_rows must hold a cache row >= 0 for each of the {self.num_tokens} keys the "
                                 f"segments name; got {len(self.key_rows)}")
        object.__setattr__(self, "_plans", {})
        # The cache rows a call needs, checked per call without a pass over key_rows.
        object.__setattr__(self, "rows_needed", self.num_tokens if self.key_rows is None else max(self.key_rows) + 1)

    @classmethod
    def groups(cls, prefix_lengths: Sequence[int], suffix_lengths: Sequence[Sequence[int]]) -> DecodeForest:
        """GRPO groups packed one after another: group g's prompt (prefix_lengths[g] tokens), then each
        of its samples' own tokens (suffix_lengths[g][i]; 0 for a sample that has none yet)."""
        if len(prefix_lengths) != len(suffix_lengths):
            raise ValueError(f"suffix_lengths has {len(suffix_lengths)} groups, prefix_lengths {len(prefix_lengths)}")
        segments, chains, pos = [], [], 0
        for g, (prefix, suffixes) in enumerate(zip(prefix_lengths, suffix_lengths)):
            if prefix < 1 or any(n < 0 for n in suffixes):
                raise ValueError(f"group {g}: prefix_lengths must be >= 1 and suffix_lengths >= 0")
            root = len(segments)
            segments.append((pos, pos + prefix))
            pos += prefix
            for n in suffixes:
                if n == 0:
                    chains.append((root,))
                    continue
                chains.append((root, len(segments)))
                segments.append((pos, pos + n))
                pos += n
        return cls(tuple(segments), tuple(chains))

    @classmethod
    def from_block_tables(cls, block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                          block_size: int) -> DecodeForest:
        """A paged cache's forest: sequences whose block tables start with the same physical blocks (a prefix
        cache's shared prompt blocks) share those keys. Returns the forest over logical key indices and
        its `key_rows`, each logical key's row in the cache (block id * block_size + offset)."""
        if len(block_tables) != len(seq_lens) or not seq_lens:
            raise ValueError(f"block_tables ({len(block_tables)}) and seq_lens ({len(seq_lens)}) need one entry "
                             "per sequence, at least one")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        root: dict = {"children": {}}
        for b, (table, length) in enumerate(zip(block_tables, seq_lens)):
            blocks = -(-length // block_size)
            if length < 1 or len(table) < blocks:
                raise ValueError(f"seq_lens[{b}] = {length} needs 1..{len(table) * block_size} tokens "
                                 f"(block_tables[{b}] holds {len(table)} blocks)")
            node = root
            for j, block in enumerate(table[:blocks]):
                # Every vLLM decoding step runs this: one dict lookup per block, a node made only when new.
                tokens = block_size if j < blocks - 1 else length - j * block_size
                child = node["children"].get(block)
                if child is None:
                    child = node["children"][block] = {"block": int(block), "tokens": tokens, "readers": [], "children": {}}
                elif child["tokens"] != tokens:
                    raise ValueError(f"block_tables[{b}][{j}] = {block} is shared but filled to {tokens} tokens "
                                     f"here and {child['tokens']} elsewhere: only full blocks are shared")
                child["readers"].append(b)
                node = child
        segments, chains, rows = [], [[] for _ in seq_lens], []

        # Depth first, without recursion: a 32K prompt in 16-token blocks is a run of 2,048 blocks.
        stack = [(child, [child]) for child in reversed(root["children"].values())]
        while stack:
            node, run = stack.pop()
            # A run of blocks read by one set of sequences is one segment.
            while len(node["children"]) == 1:
                only = next(iter(node["children"].values()))
                if only["readers"] != node["readers"]:
                    break
                node = only
                run.append(only)
            start = len(rows)
            for block in run:
                rows.extend(range(block["block"] * block_size, block["block"] * block_size + block["tokens"]))
            for b in node["readers"]:
                chains[b].append(len(segments))
            segments.append((start, len(rows)))
            stack.extend((child, [child]) for child in reversed(node["children"].values()))
        return cls(tuple(segments), tuple(map(tuple, chains)), tuple(rows))

    @property
    def num_sequences(self) -> int:
        return len(self.chains)

    @property
    def num_tokens(self) -> int:
        """The packed cache length the segments need."""
        return max(e for _, e in self.segments)

    def unshared(self) -> DecodeForest:
        """The same reads with nothing shared: each sequence gets its own copy of each of its ranges."""
        segments, chains = [], []
        for chain in self.chains:
            chains.append(tuple(range(len(segments), len(segments) + len(chain))))
            segments.extend(self.segments[i] for i in chain)
        return DecodeForest(tuple(segments), tuple(chains), self.key_rows)

    def plan(self, chunk: int, block_r: int, device: torch.device | str = "cpu") -> DecodePlan:
        """The work items (built once per chunk and block size, cached per device)."""
        if chunk < 1 or block_r < 1:
            raise ValueError(f"chunk ({chunk}) and block_r ({block_r}) must be >= 1")
        host_key, key = (chunk, block_r, "cpu"), (chunk, block_r, str(torch.device(device)))
        if host_key not in self._plans:
            self._plans[host_key] = self._build_plan(chunk, block_r)
        if key not in self._plans:
            host = self._plans[host_key]
            self._plans[key] = DecodePlan(*(t.to(device) for t in (host.k0, host.k1, host.readers, host.slots,
                                                                 host.slot_seq)), block_r,
                                          None if host.key_rows is None else host.key_rows.to(device))
        return self._plans[key]

    def _build_plan(self, chunk: int, block_r: int) -> DecodePlan:
        readers_of = [[] for _ in self.segments]
        for b, chain in enumerate(self.chains):
            for i in chain:
                readers_of[i].append(b)
        k0, k1, readers, slot_seq = [], [], [], []
        for (start, end), seqs in zip(self.segments, readers_of):
            for c in range(start, end, chunk):
                for r in range(0, len(seqs), block_r):
                    block = seqs[r : r + block_r]
                    k0.append(c)
                    k1.append(min(c + chunk, end))
                    readers.append(block + [-1] * (block_r - len(block)))
                    slot_seq.extend(block)
        readers = torch.tensor(readers, dtype=torch.int32).reshape(-1, block_r)
        slots = torch.full_like(readers, -1)
        live = readers >= 0
        slots[live] = torch.arange(int(live.sum()), dtype=torch.int32)
        return DecodePlan(torch.tensor(k0, dtype=torch.int32), torch.tensor(k1, dtype=torch.int32), readers, slots,
                          torch.tensor(slot_seq, dtype=torch.long), block_r,
                          None if self.key_rows is None else torch.tensor(self.key_rows, dtype=torch.int32))


@triton.jit
def _partials_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, k0_ptr, k1_ptr, readers_ptr, slots_ptr, key_rows_ptr,
    stride_qb, stride_qh, stride_qd, stride_kh, stride_kt, stride_kd, stride_vh, stride_vt, stride_vd,
    scale_log2, H, D, DV,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
):
    """One program per (work item, KV head): the item's readers' query heads of this KV head are the
    rows; every K/V tile of the item's keys is loaded once for all of them."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    reader = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    seq = tl.load(readers_ptr + item * BLOCK_R + reader, mask=reader < BLOCK_R, other=-1)
    slot = tl.load(slots_ptr + item * BLOCK_R + reader, mask=reader < BLOCK_R, other=-1)
    live = seq >= 0
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + seq[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=live[:, None] & (d[None, :] < D), other=0.0)
    k0 = tl.load(k0_ptr + item)
    k1 = tl.load(k1_ptr + item)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh  # a whole cache may pass 2**31 elements
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    cols = tl.arange(0, BLOCK_N)
    # Online softmax in base 2 (exp2 is the fast path); m is the running max, l the running sum.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(k0, k1, BLOCK_N):
        n = n0 + cols
        inside = n < k1
        # Paged: the forest's key index is logical; its cache row is the block table's slot.
        row = tl.load(key_rows_ptr + n, mask=inside, other=0).to(tl.int64) if PAGED else n.to(tl.int64)
        k = tl.load(k_base + row[:, None] * stride_kt + d[None, :] * stride_kd,
                    mask=inside[:, None] & (d[None, :] < D), other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k).to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds at least one key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + row[:, None] * stride_vt + dv[None, :] * stride_vd,
                    mask=inside[:, None] & (dv[None, :] < DV), other=0.0)
        # p is rounded to V's dtype as on tensor cores; the product accumulates in fp32.
        acc = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    lse = (m + tl.log2(l)) * 0.6931471805599453  # natural log, as the merge and callers expect
    slot = slot.to(tl.int64)  # the unshared baseline's slots times H * DV may pass 2**31
    tl.store(out_ptr + slot[:, None] * (H * DV) + head[:, None] * DV + dv[None, :], out,
             mask=live[:, None] & (dv[None, :] < DV))
    tl.store(lse_ptr + slot * H + head, lse, mask=live)


INTERPRETED = interpreted(_partials_kernel)
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _merge(out: torch.Tensor, lse: torch.Tensor, slot_seq: torch.Tensor, num_sequences: int):
    """Per sequence, the LSE-weighted sum of its slots' partials: [B, H, DV] and lse [B, H], fp32."""
    H = lse.shape[1]
    top = torch.full((num_sequences, H), float("-inf"), device=lse.device)
    top = top.scatter_reduce(0, slot_seq[:, None].expand(-1, H), lse, "amax")
    w = torch.exp(lse - top[slot_seq])
    den = torch.zeros_like(top).index_add_(0, slot_seq, w)
    num = torch.zeros((num_sequences, H, out.shape[-1]), device=out.device).index_add_(0, slot_seq, out * w[..., None])
    return num / den[..., None], top + torch.log(den)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, forest: DecodeForest) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q [B, H, D], k_cache [Hkv, T, D] and v_cache [Hkv, T, DV] must be 3-d, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    (B, H, D), (Hkv, T, Dk) = q.shape, k_cache.shape
    if B != forest.num_sequences:
        raise ValueError(f"q holds {B} sequences but the forest has {forest.num_sequences} chains")
    if Dk != D:
        raise ValueError(f"k_cache head size {Dk} differs from q's {D}")
    if v_cache.shape[:2] != (Hkv, T):
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)} in heads and tokens")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    if T < forest.rows_needed:
        raise ValueError(f"the forest reads cache rows up to {forest.rows_needed - 1} but the cache holds {T}")
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype not in _DOT_DTYPES:
        raise ValueError(f"q, k_cache, v_cache must share one of float32, bfloat16, float16; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not q.device == k_cache.device == v_cache.device:
        raise ValueError(f"q, k_cache, v_cache are on {q.device}, {k_cache.device}, {v_cache.device}")
    check_device(q.device, _partials_kernel, "cascade_decode")


def default_block_r(heads: int, kv_heads: int) -> int:
    """Readers per work item that fill a tile of ROWS query rows."""
    return max(1, ROWS // (heads // kv_heads))


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, forest: DecodeForest, scale: float,
                   *, chunk: int = CHUNK, block_r: int | None = None, return_lse: bool = False):
    """One decoding step's attention: q [B, H, D] (one query token per sequence), k_cache [Hkv, T, D],
    v_cache [Hkv, T, DV] (any strides: a paged cache's [blocks * block_size, Hkv, D] seen as [Hkv, T, D]);
    sequence b attends to the keys of the segments in forest.chains[b]: cache rows themselves, or for a
    paged forest (`DecodeForest.from_block_tables`) the rows its `key_rows` name.

    A work item covers at most `chunk` keys of one segment for at most `block_r` of its readers (default:
    `default_block_r`). Returns out [B, H, DV] in q's dtype, and with `return_lse` also the log-sum-exp
    [B, H] in fp32."""
    _check(q, k_cache, v_cache, forest)
    (B, H, D), (Hkv, _, DV) = q.shape, v_cache.shape
    block_r = default_block_r(H, Hkv) if block_r is None else block_r
    plan = forest.plan(chunk, block_r, q.device)
    group = H // Hkv
    slots = plan.slot_seq.numel()
    out = torch.empty((slots, H, DV), dtype=torch.float32, device=q.device)
    lse = torch.empty((slots, H), dtype=torch.float32, device=q.device)
    # tl.dot needs every dim >= 16: rows, key tile and head sizes are padded and masked. The interpreter's
    # bf16 tl.dot multiplies bit patterns (triton issue #11584): there every dot runs in fp32.
    dot_dtype = tl.float32 if INTERPRETED else _DOT_DTYPES[q.dtype]
    with on_device(q.device):
        _partials_kernel[(plan.k0.numel(), Hkv)](
            q, k_cache, v_cache, out, lse, plan.k0, plan.k1, plan.readers, plan.slots,
            plan.k0 if plan.key_rows is None else plan.key_rows, *q.stride(), *k_cache.stride(), *v_cache.stride(),
            scale * math.log2(math.e), H, D, DV,
            GROUP=group, BLOCK_R=block_r, BLOCK_M=max(16, triton.next_power_of_2(block_r * group)),
            BLOCK_N=16 if INTERPRETED else 64,
            BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(DV)),
            DOT_DTYPE=dot_dtype,
            # fp32 dots in IEEE fp32: TF32 would break fp32 parity. 16-bit inputs take the default.
            PRECISION="ieee" if dot_dtype == tl.float32 else None, PAGED=plan.key_rows is not None,
        )
    merged, merged_lse = _merge(out, lse, plan.slot_seq, B)
    return (merged.to(q.dtype), merged_lse) if return_lse else merged.to(q.dtype)


def kv_read_bytes(forest: DecodeForest, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                  chunk: int = CHUNK, block_r: int | None = None) -> int:
    """K/V bytes that `cascade_decode` with these arguments reads from the cache: each item's keys once
    per KV head.

    With every segment's readers in one block, a cascade forest reads each segment once per KV head;
    its `unshared()` forest reads each segment once per reader."""
    plan = forest.plan(chunk, default_block_r(q.shape[1], k_cache.shape[0]) if block_r is None else block_r)
    per_key = k_cache.shape[-1] * k_cache.element_size() + v_cache.shape[-1] * v_cache.element_size()
    return plan.keys_read * k_cache.shape[0] * per_key
