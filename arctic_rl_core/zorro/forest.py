"""Packing sequences into a prefix forest.

Sequences are sorted lexicographically by their tokens, so any two that share
a prefix are neighbours, and the longest prefix a sequence shares with *any*
earlier one is the one it shares with its predecessor (its LCP). Walking the
sorted list with a stack of open segments builds the radix tree directly: a
sequence closes the segments below its LCP, splits the segment its LCP ends
inside, and appends its remaining tokens as a new segment. Tokens are never
moved, so the packed order is depth-first and `ForestLayout`'s mask rule holds.

Sharing is found from the tokens themselves, so it covers GRPO groups (with or
without a group id), nested groups (a system prompt shared by several groups)
and multi-turn data (a conversation's earlier turns shared by its later ones).
With router replay a token is shared only where the sequences' routing records
agree on it too, so replay gives the same results packed or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from arctic_rl_kernels.layout import ForestLayout


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PackedForest:
    tokens: list[int]
    position_ids: list[int]
    """Depth of each packed token in its sequence: shared tokens keep their positions."""
    layout: ForestLayout
    paths: list[list[int]]
    """For each input sequence, the packed index of each of its tokens."""


@dataclass
class _Open:
    segment: int
    depth_start: int
    depth_end: int


def routes_agree(a: np.ndarray | None, b: np.ndarray | None, n: int) -> int:
    """How many of the first `n` tokens two routing records ([tokens, layers * top_k], None: route natively) route
    alike: rows equal, or both records ended before them (both native there)."""
    if a is None or b is None:
        return n if a is None and b is None else 0
    m = min(n, len(a), len(b))
    differ = np.flatnonzero((a[:m] != b[:m]).any(axis=1))
    if differ.size:
        return int(differ[0])
    return n if len(a) == len(b) == m else m


def pack_forest(sequences: list[list[int]], min_shared_tokens: int = 1,
                routes: list[np.ndarray | None] | None = None) -> PackedForest:
    """Pack `sequences` (already in lexicographic order) into one depth-first prefix forest.

    A prefix shorter than `min_shared_tokens` is not shared; with `routes` (per sequence, its routing record
    [tokens, layers * top_k] or None), nor are tokens past where two records differ.
    """
    tokens: list[int] = []
    positions: list[int] = []
    segments: list[list[int]] = []  # [start, end, subtree_end or None]
    stack: list[_Open] = []
    paths: list[list[int]] = []
    previous: list[int] | None = None
    path: list[int] = []
    for seq in sequences:
        if previous is not None and seq < previous:
            raise ValueError("pack_forest needs its sequences in lexicographic order")
        shared = common_prefix_length(previous, seq) if previous is not None else 0
        if routes is not None and shared:
            shared = routes_agree(routes[len(paths) - 1], routes[len(paths)], shared)
        if shared < min_shared_tokens:
            shared = 0
        while stack and stack[-1].depth_start >= shared:
            segments[stack.pop().segment][2] = len(tokens)
        if stack and stack[-1].depth_end > shared:
            # The shared prefix ends inside this segment: split it; the tail becomes a closed child.
            top = stack[-1]
            start, end, _ = segments[top.segment]
            cut = start + (shared - top.depth_start)
            segments[top.segment][1] = cut
            segments.append([cut, end, len(tokens)])
            top.depth_end = shared
        path = path[:shared]
        if shared < len(seq):
            segments.append([len(tokens), len(tokens) + len(seq) - shared, None])
            stack.append(_Open(len(segments) - 1, shared, len(seq)))
            path += range(len(tokens), len(tokens) + len(seq) - shared)
            tokens.extend(seq[shared:])
            positions.extend(range(shared, len(seq)))
        paths.append(list(path))
        previous = seq
    for open_segment in stack:
        segments[open_segment.segment][2] = len(tokens)
    segments.sort(key=lambda s: s[0])
    layout = ForestLayout(
        tuple(s[0] for s in segments), tuple(s[1] for s in segments), tuple(s[2] for s in segments), len(tokens)
    )
    return PackedForest(tokens, positions, layout, paths)


def plan_forest_micro_batches(sequences: list[list[int]], token_budget: int, min_shared_tokens: int = 1) -> list[list[int]]:
    """Indices of `sequences` per micro-batch, each in lexicographic order, at most `token_budget` packed tokens.

    A group larger than the budget continues in the next micro-batch, which computes its prefix again.
    """
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    batches: list[list[int]] = []
    current: list[int] = []
    cost = 0
    for i in order:
        shared = common_prefix_length(sequences[current[-1]], sequences[i]) if current else 0
        added = len(sequences[i]) - (shared if shared >= min_shared_tokens else 0)
        if current and cost + added > token_budget:
            batches.append(current)
            current, cost, added = [], 0, len(sequences[i])
        current.append(i)
        cost += added
    if current:
        batches.append(current)
    return batches
