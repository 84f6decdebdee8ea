"""Forest cascade attention for decoding: each sequence's one new query token attends to its KV cache,
a chain of segments (shared prefixes, root to leaf, then its own suffix) in one packed cache.

A shared segment's K/V is read once for all the sequences that read it: one work item stacks the
query heads of every reader of one KV head as the rows of one tile (GQA without repeating K/V), as
FlashInfer's shared-prefix cascade decode does. Long segments are split into key chunks (split-K, as
in flash-decoding), as finely as it takes to give every multiprocessor a program at the forest's G and
prompt length (`fill_chunk`). Each (item, KV head) program writes a partial
output and log-sum-exp per reader into a slot; a second kernel merges each sequence's slots by LSE, reading
them through the plan's list of slots per sequence. The plan is built once per forest, on the host, and
uploaded once per device: vLLM's backend finds the forest once per decoding step and every layer reuses it.

`DecodeForest.unshared()` is the baseline with the same kernel: every sequence reads its own copy of
each range, as plain paged decoding does. `DecodeForest.from_block_tables` finds the forest of a paged
cache (vLLM's layout): sequences whose block tables start with the same physical blocks, as a prefix
cache lays out a group's prompt, share them; keys are then read through their cache rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from arctic_rl_kernels.triton_device import check_device, interpreted, on_device

CHUNKS = (2048, 1024, 512, 256)
"""Keys per work item, largest first: `fill_chunk` picks one per forest."""
ROWS = 64
"""Query rows per tile by default: readers per work item are ROWS // (H // Hkv); a segment read by more
sequences is read once per block of that many."""


@dataclass(frozen=True)
class DecodePlan:
    """The work items of one forest, as int32 tensors on one device.

    Item i covers keys [k0[i], k1[i]) of one segment for the sequences readers[i] (-1 padded); reader j of
    item i writes its partial to slot slots[i, j]. The merge reads sequence b's slots from a CSR list:
    seq_slots[seq_slot_start[b] : seq_slot_start[b + 1]]."""

    k0: torch.Tensor
    k1: torch.Tensor
    readers: torch.Tensor
    slots: torch.Tensor
    seq_slot_start: torch.Tensor
    seq_slots: torch.Tensor
    block_r: int
    key_rows: torch.Tensor | None = None
    """int32 cache row of each logical key (a paged forest's), else None."""

    @property
    def keys_read(self) -> int:
        """Keys the items read per KV head: a key is read once per item covering it."""
        return int((self.k1 - self.k0).sum())

    @property
    def num_slots(self) -> int:
        return self.seq_slots.numel()

    def to(self, device: torch.device | str) -> DecodePlan:
        """This plan on `device` in one copy: a decoding step's first layer uploads it with one transfer that does
        not wait for the work already queued on the device (vLLM reuses the plan in every layer of the step)."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        tensors = [getattr(self, name) for name in names]
        # Each tensor padded to 16 bytes: Triton compiles a kernel per pointer alignment, so unaligned views of one
        # buffer would compile new variants as plans change.
        sizes = [-(-t.numel() // 4) * 4 for t in tensors]
        packed = torch.zeros(sum(sizes), dtype=torch.int32)
        for t, view in zip(tensors, packed.split(sizes)):
            view[: t.numel()] = t.flatten()
        if torch.device(device).type == "cuda":
            packed = packed.pin_memory()  # a pinned copy is asynchronous; a pageable one synchronizes the stream
        packed = packed.to(device, non_blocking=True)
        return replace(self, **{name: view[: t.numel()].view(t.shape)
                                for name, t, view in zip(names, tensors, packed.split(sizes))})


@dataclass(frozen=True)
class DecodeForest:
    """Which ranges of a packed KV cache each decoding sequence reads."""

    segments: tuple[tuple[int, int], ...]
    """(start, end) of each segment in the packed cache. Ranges may alias: `unshared()` gives every
    reader its own copy of a range."""
    chains: tuple[tuple[int, ...], ...]
    """Per sequence, the ids of the segments it reads, root to leaf."""
    key_rows: torch.Tensor | None = field(default=None, compare=False)
    """A paged cache's row of each key index the segments name (`from_block_tables`), int32 on the host; None: the
    rows themselves."""

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
            rows = torch.as_tensor(self.key_rows).to("cpu", torch.int32).reshape(-1)
            object.__setattr__(self, "key_rows", rows)
            if rows.numel() < self.num_tokens or int(rows.min()) < 0:
                raise ValueError(f"key_rows must hold a cache row >= 0 for each of the {self.num_tokens} keys the "
                                 f"segments name; got {rows.numel()}")
        object.__setattr__(self, "_plans", {})
        counts = [0] * len(self.segments)
        for chain in self.chains:
            for i in chain:
                counts[i] += 1
        object.__setattr__(self, "reader_counts", tuple(counts))
        """How many sequences read each segment."""
        # The cache rows a call needs, checked per call without a pass over key_rows.
        object.__setattr__(self, "rows_needed", self.num_tokens if self.key_rows is None else int(self.key_rows.max()) + 1)

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
    def from_block_tables(cls, block_tables, seq_lens: Sequence[int], block_size: int) -> DecodeForest:
        """A paged cache's forest: sequences whose block tables start with the same physical blocks (a prefix
        cache's shared prompt blocks) share those keys. Returns the forest over logical key indices and
        its `key_rows`, each logical key's row in the cache (block id * block_size + offset).

        `block_tables`: a row of block ids per sequence (a 2-D tensor or array, as vLLM keeps them, or lists);
        entries past a sequence's last block are ignored. Every vLLM decoding step runs this, so the per-block work
        is on arrays: the tables sorted (sequences that share a prefix become neighbours), each neighbour pair's
        longest common prefix, and from those the trie's branch points, in Python once per sequence."""
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if len(block_tables) != len(lens) or not len(lens):
            raise ValueError(f"block_tables ({len(block_tables)}) and seq_lens ({len(lens)}) need one entry "
                             "per sequence, at least one")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        blocks = -(-lens // block_size)
        tables, held = _block_matrix(block_tables, len(lens))
        for b in np.flatnonzero((lens < 1) | (blocks > held))[:1]:
            raise ValueError(f"seq_lens[{b}] = {lens[b]} needs 1..{held[b] * block_size} tokens "
                             f"(block_tables[{b}] holds {held[b]} blocks)")
        tables = tables[:, : blocks.max()]
        tables[np.arange(tables.shape[1]) >= blocks[:, None]] = -1
        last = lens - (blocks - 1) * block_size  # tokens in each sequence's last block; the others are full

        def tokens(b: int, j: int) -> int:
            return int(last[b]) if j == blocks[b] - 1 else block_size

        order = sorted(range(len(lens)), key=lambda b: tables[b].tobytes())  # equal prefixes become neighbours
        ordered = tables[order]
        differ = ordered[1:] != ordered[:-1]
        lcp = np.where(differ.any(1), differ.argmax(1), tables.shape[1])
        lcp = np.minimum(lcp, np.minimum(blocks[order][1:], blocks[order][:-1])).tolist()
        for i, shared in enumerate(lcp):
            a, b = sorted((order[i], order[i + 1]))
            # Only a sequence's last block may be partial, so only the last block two sequences share can differ.
            if shared and tokens(a, shared - 1) != tokens(b, shared - 1):
                raise ValueError(f"block_tables[{b}][{shared - 1}] = {tables[b, shared - 1]} is shared but filled to "
                                 f"{tokens(b, shared - 1)} tokens here and {tokens(a, shared - 1)} in sequence {a}: "
                                 "only full blocks are shared")

        # The compressed trie of the sorted tables: nodes [depth, children, sequences ending here], a node holding
        # the blocks from its parent's depth to its own; a neighbour pair's common prefix is a branch point.
        root = [0, [], []]
        path = [root]
        for i, b in enumerate(order):
            if i:
                left = None
                while path[-1][0] > lcp[i - 1]:
                    left = path.pop()
                if path[-1][0] < lcp[i - 1]:  # the branch point lies inside the node just left: split it there
                    branch = [lcp[i - 1], [left], []]
                    path[-1][1][-1] = branch
                    path.append(branch)
            if blocks[b] > path[-1][0]:
                leaf = [int(blocks[b]), [], [b]]
                path[-1][1].append(leaf)
                path.append(leaf)
            else:  # its table is another's prefix, or the same as one
                path[-1][2].append(b)

        def readers(node) -> list[int]:
            found, todo = [], [node]
            while todo:
                found += todo[-1][2]
                todo += todo.pop()[1]
            return sorted(found)

        def in_arrival_order(nodes):  # siblings by their first sequence; reversed for the stack
            return sorted(nodes, key=lambda n: readers(n)[0], reverse=True)

        # Depth first, without recursion (a 32K prompt in 16-token blocks is a run of 2,048 blocks).
        segments, chains, pieces, offset = [], [[] for _ in lens], [], 0
        columns = np.arange(block_size)
        stack = [(child, 0) for child in in_arrival_order(root[1])]
        while stack:
            node, start = stack.pop()
            seqs = readers(node)
            rows = (tables[seqs[0], start : node[0], None] * block_size + columns).reshape(-1)
            rows = rows[: rows.size - block_size + tokens(seqs[0], node[0] - 1)]
            for b in seqs:
                chains[b].append(len(segments))
            segments.append((offset, offset + rows.size))
            pieces.append(rows)
            offset += rows.size
            stack += [(child, node[0]) for child in in_arrival_order(node[1])]
        return cls(tuple(segments), tuple(map(tuple, chains)), torch.from_numpy(np.concatenate(pieces)))

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
            self._plans[key] = self._plans[host_key].to(device)
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
        # Slots are numbered item by item; the merge reads them sequence by sequence.
        slot_seq = torch.tensor(slot_seq, dtype=torch.long)
        seq_slot_start = torch.zeros(self.num_sequences + 1, dtype=torch.int32)
        seq_slot_start[1:] = torch.bincount(slot_seq, minlength=self.num_sequences).cumsum(0)
        return DecodePlan(torch.tensor(k0, dtype=torch.int32), torch.tensor(k1, dtype=torch.int32), readers, slots,
                          seq_slot_start, torch.argsort(slot_seq, stable=True).to(torch.int32), block_r,
                          self.key_rows)


def _block_matrix(block_tables, sequences: int) -> tuple[np.ndarray, np.ndarray]:
    """Block tables as an int64 [sequences, width] matrix (-1 where a list is short), and how many blocks each
    sequence's table holds."""
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.detach().cpu().numpy()
    if isinstance(block_tables, np.ndarray) and block_tables.ndim == 2:
        return block_tables.astype(np.int64), np.full(sequences, block_tables.shape[1])
    held = np.array([len(table) for table in block_tables])
    matrix = np.full((sequences, max(1, int(held.max()))), -1, dtype=np.int64)
    for b, table in enumerate(block_tables):
        matrix[b, : len(table)] = table
    return matrix, held


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


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, seq_slot_start_ptr, seq_slots_ptr, out_ptr, lse_ptr, H, DV,
                  BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (sequence, query head): out = sum_i exp(lse_i - lse) * out_i and lse = logsumexp_i lse_i
    over the sequence's slots i, BLOCK_S slots at a time with a running max (online, in fp32)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(seq_slot_start_ptr + seq)
    last = tl.load(seq_slot_start_ptr + seq + 1)
    dv = tl.arange(0, BLOCK_DV)
    top = tl.full([], float("-inf"), tl.float32)  # the largest slot LSE so far
    den = tl.zeros([], tl.float32)  # sum of exp(lse_i - top)
    acc = tl.zeros([BLOCK_DV], tl.float32)  # sum of exp(lse_i - top) * out_i
    for s0 in range(first, last, BLOCK_S):
        i = s0 + tl.arange(0, BLOCK_S)
        inside = i < last
        slot = tl.load(seq_slots_ptr + i, mask=inside, other=0).to(tl.int64)
        lse = tl.load(part_lse_ptr + slot * H + head, mask=inside, other=float("-inf"))
        top_new = tl.maximum(top, tl.max(lse, 0))  # finite: every block holds a slot
        alpha = tl.exp(top - top_new)
        w = tl.exp(lse - top_new)
        part = tl.load(part_out_ptr + slot[:, None] * (H * DV) + head * DV + dv[None, :],
                       mask=inside[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        den = den * alpha + tl.sum(w, 0)
        top = top_new
    row = seq.to(tl.int64) * H + head
    tl.store(out_ptr + row * DV + dv, (acc / den).to(out_ptr.dtype.element_ty), mask=dv < DV)
    tl.store(lse_ptr + row, top + tl.log(den))


INTERPRETED = interpreted(_partials_kernel)
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class LaunchConfig:
    """How the kernels run: the partials kernel's keys per tile, warps and software-pipeline stages, and the
    merge's slots per step."""

    block_n: int
    num_warps: int
    num_stages: int
    merge_slots: int


def launch_config(dtype: torch.dtype, head_dim: int, interpreted: bool = INTERPRETED) -> LaunchConfig:
    """The default launch: for Hopper, 16-bit K/V of head size 128 in 64-key tiles (32 KiB of K and V per
    stage), three stages in flight. `bench cascade --sweep` times others on a GPU."""
    if interpreted:
        # Small tiles keep the interpreter's numpy ops small, and let small tests span several of them.
        return LaunchConfig(block_n=16, num_warps=4, num_stages=1, merge_slots=4)
    elem = torch.finfo(dtype).bits // 8
    block_n = 64 if elem == 2 else 32  # fp32 halves the tile: the same bytes per stage
    stage_bytes = block_n * 2 * head_dim * elem
    # Three stages while K and V take at most 96 KiB: the default's kernel then holds 112 KiB of shared memory on
    # sm_90, so two programs still fit an SM (228 KiB on Hopper). Head sizes past 128 take 8 warps: on 4 the
    # accumulator and the K/V tile need more than 255 registers per thread and spill (tests/test_kernel_compile.py).
    return LaunchConfig(block_n, num_warps=8 if head_dim > 128 else 4,
                        num_stages=3 if 3 * stage_bytes <= 96 * 1024 else 2, merge_slots=32)


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, seq_slot_start: torch.Tensor,
                   seq_slots: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, merge_slots: int) -> None:
    """Writes into out [B, H, DV] (any float dtype) and lse [B, H] (fp32) each sequence's merge of its slots'
    partials, part_out [slots, H, DV] and part_lse [slots, H] (fp32, contiguous); sequence b's slots are
    seq_slots[seq_slot_start[b] : seq_slot_start[b + 1]] (int32)."""
    (B, H, DV) = out.shape
    with on_device(out.device):
        _merge_kernel[(B, H)](part_out, part_lse, seq_slot_start, seq_slots, out, lse, H, DV,
                              BLOCK_S=merge_slots, BLOCK_DV=triton.next_power_of_2(DV))


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


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # Under the interpreter (a CPU) one program at a time: the longest items, the fewest programs.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def fill_chunk(forest: DecodeForest, kv_heads: int, block_r: int, device: torch.device) -> int:
    """The largest of `CHUNKS` that splits the shared segments (those with several readers; every segment where none
    is shared) into at least one program per two multiprocessors of `device` (times the KV heads): the shared
    prompt is nearly all of the K/V read, and fewer, longer items stream it with less to merge. On an H100, at the
    six shapes swept (32K prompts at G = 8, 16, 32, 64; 4K at G = 8, 64) this pick ran within 7% of the fastest
    chunk, within 2% at five; a fixed chunk was up to 18% off (2048 at a 4K prompt, G=64) or 11% (512 at 32K, G=8)
    (docs/benchmarks.md)."""
    shared = [i for i, readers in enumerate(forest.reader_counts) if readers > 1] or range(len(forest.segments))
    for chunk in CHUNKS:
        items = sum(-(-(forest.segments[i][1] - forest.segments[i][0]) // chunk) * -(-forest.reader_counts[i] // block_r)
                    for i in shared)
        if 2 * items * kv_heads >= _multiprocessors(device):
            return chunk
    return CHUNKS[-1]


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, forest: DecodeForest, scale: float,
                   *, chunk: int | None = None, block_r: int | None = None, launch: LaunchConfig | None = None,
                   return_lse: bool = False):
    """One decoding step's attention: q [B, H, D] (one query token per sequence), k_cache [Hkv, T, D],
    v_cache [Hkv, T, DV] (any strides: a paged cache's [blocks * block_size, Hkv, D] seen as [Hkv, T, D]);
    sequence b attends to the keys of the segments in forest.chains[b]: cache rows themselves, or for a
    paged forest (`DecodeForest.from_block_tables`) the rows its `key_rows` name.

    A work item covers at most `chunk` keys of one segment (default: `fill_chunk`) for at most `block_r` of its
    readers (default: `default_block_r`); `launch` defaults to `launch_config`. Returns out [B, H, DV] in q's dtype, and with
    `return_lse` also the log-sum-exp [B, H] in fp32."""
    _check(q, k_cache, v_cache, forest)
    (B, H, D), (Hkv, _, DV) = q.shape, v_cache.shape
    block_r = default_block_r(H, Hkv) if block_r is None else block_r
    chunk = fill_chunk(forest, Hkv, block_r, q.device) if chunk is None else chunk
    launch = launch_config(q.dtype, D) if launch is None else launch
    plan = forest.plan(chunk, block_r, q.device)
    group = H // Hkv
    part_out = torch.empty((plan.num_slots, H, DV), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((plan.num_slots, H), dtype=torch.float32, device=q.device)
    # tl.dot needs every dim >= 16: rows, key tile and head sizes are padded and masked. The interpreter's
    # bf16 tl.dot multiplies bit patterns (triton issue #11584): there every dot runs in fp32.
    dot_dtype = tl.float32 if INTERPRETED else _DOT_DTYPES[q.dtype]
    with on_device(q.device):
        _partials_kernel[(plan.k0.numel(), Hkv)](
            q, k_cache, v_cache, part_out, part_lse, plan.k0, plan.k1, plan.readers, plan.slots,
            plan.k0 if plan.key_rows is None else plan.key_rows, *q.stride(), *k_cache.stride(), *v_cache.stride(),
            scale * math.log2(math.e), H, D, DV,
            GROUP=group, BLOCK_R=block_r, BLOCK_M=max(16, triton.next_power_of_2(block_r * group)),
            BLOCK_N=launch.block_n,
            BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(DV)),
            DOT_DTYPE=dot_dtype,
            # fp32 dots in IEEE fp32: TF32 would break fp32 parity. 16-bit inputs take the default.
            PRECISION="ieee" if dot_dtype == tl.float32 else None, PAGED=plan.key_rows is not None,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
    out = torch.empty((B, H, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H), dtype=torch.float32, device=q.device)
    merge_partials(part_out, part_lse, plan.seq_slot_start, plan.seq_slots, out, lse, launch.merge_slots)
    return (out, lse) if return_lse else out


def kv_read_bytes(forest: DecodeForest, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                  chunk: int | None = None, block_r: int | None = None) -> int:
    """K/V bytes that `cascade_decode` with these arguments reads from the cache: each item's keys once
    per KV head.

    With every segment's readers in one block, a cascade forest reads each segment once per KV head;
    its `unshared()` forest reads each segment once per reader."""
    block_r = default_block_r(q.shape[1], k_cache.shape[0]) if block_r is None else block_r
    chunk = fill_chunk(forest, k_cache.shape[0], block_r, q.device) if chunk is None else chunk
    plan = forest.plan(chunk, block_r)
    per_key = k_cache.shape[-1] * k_cache.element_size() + v_cache.shape[-1] * v_cache.element_size()
    return plan.keys_read * k_cache.shape[0] * per_key
