"""Which prompt prefixes a sampler replica computed lately, so a pool sends a prompt where its prefix is cached.

A multi-turn episode's next turn is its history plus a little: sent to the replica that sampled the last turn,
the history's KV comes from that replica's prefix cache instead of a prefill. Prompts are matched in whole
blocks of `BLOCK` tokens by chained hashes (a block's hash covers every token before it, as vLLM's prefix cache
keys its blocks), most recently used kept. The index is what the pool dealt, not what the engine holds: the
engine may have evicted a block since, so a match is a likely saving, never assumed for correctness.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16
"""Tokens per hashed block: a prompt shares a prefix with another in whole blocks."""


def block_hashes(prompt: list[int]) -> list[int]:
    """One hash per whole block of `prompt`, each covering the blocks before it."""
    hashes, previous = [], 0
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        previous = hash((previous, *prompt[end - BLOCK:end]))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The block hashes of what one replica was sent, least recently used dropped past `capacity_blocks`."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def cached_tokens(self, hashes: list[int]) -> int:
        """How many leading tokens of the prompt with these block hashes the replica likely holds."""
        held = 0
        for h in hashes:
            if h not in self._blocks:
                break
            held += 1
        return held * BLOCK

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        """The replica's prefix cache was emptied (a weight sync, a replacement)."""
        self._blocks.clear()
