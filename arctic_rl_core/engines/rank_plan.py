"""Which trainer rank runs which micro-batch.

The driver builds the micro-batches of a call as one rank would (so every loss
denominator is the whole batch's), then deals them to ranks:
- a GRPO group never spans ranks: micro-batches sharing a group (a group over
  the token budget is split between micro-batches) form one unit, and a unit
  goes to one rank, so its prefix tree is computed once;
- units are balanced by the tokens each rank computes, after ZoRRo's
  deduplication (a packed forest's length), largest first onto the least
  loaded rank;
- every rank runs the same number of micro-batches: ZeRO-3 gathers parameters
  in every forward and ZeRO-2 reduces gradients in every backward, both
  collectives, so a rank with fewer real micro-batches runs copies of one
  with its loss weighted 0 (its gradient is exactly zero).
"""

from __future__ import annotations

from dataclasses import dataclass

from arctic_rl_core.batching import MicroBatch


@dataclass(frozen=True)
class RankPlan:
    micro_batches: list[list[int]]
    """Per rank, indexes into the call's micro-batches, in order."""
    fillers: list[int]
    """Per rank, how many zero-weighted copies of micro-batch `filler` it runs after its own."""
    filler: int
    """The call's smallest micro-batch, by computed tokens."""
    groups: list[set[int]]
    """Per rank, the GRPO groups (dense indexes over the call) its micro-batches hold."""

    @property
    def ranks(self) -> int:
        return len(self.micro_batches)


def _units(micro_batches: list[MicroBatch]) -> list[list[int]]:
    """Micro-batches that share a GRPO group, joined (union-find over group indexes)."""
    parent = list(range(len(micro_batches)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, mb in enumerate(micro_batches):
        for group in mb.inputs.group_index.unique().tolist():
            if group in owner:
                parent[root(i)] = root(owner[group])
            else:
                owner[group] = i
    units: dict[int, list[int]] = {}
    for i in range(len(micro_batches)):
        units.setdefault(root(i), []).append(i)
    return list(units.values())


def plan_ranks(micro_batches: list[MicroBatch], ranks: int) -> RankPlan:
    computed = [int(mb.input_ids.numel()) for mb in micro_batches]
    units = sorted(_units(micro_batches), key=lambda unit: (-sum(computed[i] for i in unit), unit[0]))
    load = [0] * ranks
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    for unit in units:
        rank = min(range(ranks), key=lambda r: (load[r], len(assigned[r]), r))
        assigned[rank].extend(unit)
        load[rank] += sum(computed[i] for i in unit)
    assigned = [sorted(a) for a in assigned]
    most = max(len(a) for a in assigned)
    smallest = min(range(len(micro_batches)), key=lambda i: computed[i])
    groups = [{g for i in a for g in micro_batches[i].inputs.group_index.unique().tolist()} for a in assigned]
    return RankPlan(assigned, [most - len(a) for a in assigned], smallest, groups)
