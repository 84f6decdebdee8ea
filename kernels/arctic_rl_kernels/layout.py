"""The layout of a packed prefix forest, as attention sees it.

Tokens are packed in depth-first order: every segment (a run of tokens on one
tree edge) is followed by its whole subtree. Then a single rule gives the
mask: key k is visible to query q iff

    k <= q  and  q < subtree_end[k]

i.e. k precedes q and q lies in the subtree of k's segment: k is an ancestor
token or an earlier token of q's own segment. Plain packing (no sharing) is
the special case where every sequence is one segment with no children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ForestLayout:
    starts: tuple[int, ...]
    """First packed index of each segment, in depth-first order."""
    ends: tuple[int, ...]
    """One past the last packed index of each segment's own tokens."""
    subtree_ends: tuple[int, ...]
    """One past the last packed index of each segment's subtree (== end for a leaf)."""
    num_tokens: int
    _buckets: list = field(default=None, compare=False, repr=False)
    _positions: torch.Tensor = field(default=None, compare=False, repr=False)
    _tables: dict = field(default_factory=dict, compare=False, repr=False)
    """Kernel tables and positions, built once per block size and device."""

    def __post_init__(self):
        n = len(self.starts)
        if not (len(self.ends) == len(self.subtree_ends) == n):
            raise ValueError("starts, ends and subtree_ends must have one entry per segment")
        covered = 0
        open_subtrees: list[int] = []  # subtree ends of the segments enclosing the current one
        for s, e, t in zip(self.starts, self.ends, self.subtree_ends):
            while open_subtrees and open_subtrees[-1] <= s:
                open_subtrees.pop()
            nested = not open_subtrees or t <= open_subtrees[-1]
            if not (s == covered and s < e <= t <= self.num_tokens and nested):
                raise ValueError(f"segment [{s}, {e}) / subtree end {t} breaks depth-first packing")
            open_subtrees.append(t)
            covered = e
        if covered != self.num_tokens:
            raise ValueError(f"segments cover {covered} of {self.num_tokens} tokens")

    @staticmethod
    def unshared(lengths: list[int]) -> "ForestLayout":
        """Plain packing: every sequence its own segment."""
        starts, pos = [], 0
        for n in lengths:
            starts.append(pos)
            pos += n
        ends = tuple(s + n for s, n in zip(starts, lengths))
        return ForestLayout(tuple(starts), ends, ends, pos)

    @staticmethod
    def groups(prompt_lengths: list[int], response_lengths: list[list[int]]) -> "ForestLayout":
        """GRPO groups packed one after another: group g's prompt, then each of its responses."""
        if len(prompt_lengths) != len(response_lengths):
            raise ValueError(f"response_lengths has {len(response_lengths)} groups, prompt_lengths {len(prompt_lengths)}")
        starts, ends, subtree_ends, pos = [], [], [], 0
        for prompt, responses in zip(prompt_lengths, response_lengths):
            starts.append(pos)
            ends.append(pos + prompt)
            subtree_ends.append(pos + prompt + sum(responses))
            pos += prompt
            for n in responses:
                starts.append(pos)
                ends.append(pos + n)
                subtree_ends.append(pos + n)
                pos += n
        return ForestLayout(tuple(starts), tuple(ends), tuple(subtree_ends), pos)

    def token_subtree_ends(self) -> torch.Tensor:
        out = torch.empty(self.num_tokens, dtype=torch.long)
        for s, e, t in zip(self.starts, self.ends, self.subtree_ends):
            out[s:e] = t
        return out

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N] position of each packed token in its sequence: its segment's depth plus its offset.
        A segment's depth is the total length of the segments enclosing it. Kept once per device."""
        if str(device) != "cpu":
            key = ("positions", str(device))
            if key not in self._tables:
                self._tables[key] = self.positions().to(device)
            return self._tables[key]
        if self._positions is None:
            out = torch.empty(self.num_tokens, dtype=torch.long)
            for seg, ancestors in enumerate(self.ancestors()):
                depth = sum(self.ends[a] - self.starts[a] for a in ancestors)
                out[self.starts[seg]:self.ends[seg]] = torch.arange(depth, depth + self.ends[seg] - self.starts[seg])
            object.__setattr__(self, "_positions", out)
        return self._positions

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """[N, N] boolean visibility (for the reference implementation and tests only). With a sliding
        `window`, a key is also hidden from queries `window` or more positions after it."""
        idx = torch.arange(self.num_tokens)
        q, k = idx[:, None], idx[None, :]
        mask = (k <= q) & (q < self.token_subtree_ends()[None, :])
        if window is not None:
            pos = self.positions()
            mask &= (pos[:, None] - pos[None, :]) < window
        return mask

    def ancestors(self) -> list[list[int]]:
        """Each segment's enclosing segments, root first."""
        out, open_segments = [], []
        for i, s in enumerate(self.starts):
            while open_segments and self.subtree_ends[open_segments[-1]] <= s:
                open_segments.pop()
            out.append(list(open_segments))
            open_segments.append(i)
        return out

    def query_tiles(self, block: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """Tiles of at most `block` queries, none crossing a segment, and the key ranges each tile sees, for a
        fused kernel: int32 (q_start, q_end, range_ptr, k_start, k_end). Tile t's ranges are
        range_ptr[t]:range_ptr[t+1]: its segment's ancestors, whole, then its own segment up to the tile's end
        (the rule `k <= q` is the causal mask inside it and holds for every ancestor token). Built once per
        block size and device (every layer's forward and backward reads them)."""
        key = ("q", block, str(device))
        if key not in self._tables and str(device) != "cpu":
            self._tables[key] = tuple(t.to(device) for t in self.query_tiles(block))
        if key not in self._tables:
            q_start, q_end, ptr, k_start, k_end = [], [], [0], [], []
            for seg, ancestors in enumerate(self.ancestors()):
                s, e = self.starts[seg], self.ends[seg]
                for t in range(s, e, block):
                    q_start.append(t)
                    q_end.append(min(t + block, e))
                    for a in ancestors:
                        k_start.append(self.starts[a])
                        k_end.append(self.ends[a])
                    k_start.append(s)
                    k_end.append(q_end[-1])
                    ptr.append(len(k_start))
            self._tables[key] = tuple(torch.tensor(x, dtype=torch.int32) for x in (q_start, q_end, ptr, k_start, k_end))
        return self._tables[key]

    def key_tiles(self, block: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """Tiles of at most `block` keys, none crossing a segment, and the queries that see them: int32
        (k_start, k_end, q_end). Depth-first packing makes those one range, [k_start, q_end): the rest of the
        key's segment (causal) and then its whole subtree."""
        key = ("k", block, str(device))
        if key not in self._tables and str(device) != "cpu":
            self._tables[key] = tuple(t.to(device) for t in self.key_tiles(block))
        if key not in self._tables:
            k_start, k_end, q_end = [], [], []
            for s, e, t in zip(self.starts, self.ends, self.subtree_ends):
                for k in range(s, e, block):
                    k_start.append(k)
                    k_end.append(min(k + block, e))
                    q_end.append(t)
            self._tables[key] = tuple(torch.tensor(x, dtype=torch.int32) for x in (k_start, k_end, q_end))
        return self._tables[key]

    @property
    def longest(self) -> int:
        """The longest sequence's length (a root-to-leaf path): the length `auto` picks a backend by."""
        if "longest" not in self._tables:
            self._tables["longest"] = int(self.positions().max()) + 1
        return self._tables["longest"]

    def cross_parts(self) -> list[tuple[int, int, int, int]]:
        """(key_start, key_end, query_start, query_end): a segment's tokens seen, unmasked, by its whole subtree."""
        return [(s, e, e, t) for s, e, t in zip(self.starts, self.ends, self.subtree_ends) if t > e]

    def self_buckets(self, max_waste: float = 0.25) -> list[tuple[list[int], int]]:
        """Segments grouped by length for batched causal self-attention: (segment ids, padded length)."""
        if self._buckets is not None:
            return self._buckets
        order = sorted(range(len(self.starts)), key=lambda i: self.ends[i] - self.starts[i])
        buckets: list[tuple[list[int], int]] = []
        for i in order:
            n = self.ends[i] - self.starts[i]
            if buckets:
                members, _ = buckets[-1]
                shortest = self.ends[members[0]] - self.starts[members[0]]
                if n <= shortest * (1 + max_waste) + 8:
                    members.append(i)
                    buckets[-1] = (members, n)
                    continue
            buckets.append(([i], n))
        object.__setattr__(self, "_buckets", buckets)
        return buckets
