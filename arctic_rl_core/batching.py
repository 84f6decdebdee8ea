"""From a list of `Sequence`s to micro-batches and per-token loss inputs.

Two layouts, same contract:
- padded: a right-padded [B, L] batch (attention cost per sequence only);
- forest (ZoRRo): one packed row per micro-batch in which every shared prefix
  appears once, with position ids and a `ForestLayout` for split attention.
Either way a micro-batch carries the flat index of the position that predicts
each response token (the first response token is predicted by the last prompt
position, shared or not). Micro-batches hold whole GRPO groups where the token
budget allows; a group bigger than the budget is split between sequences,
never inside one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.types import Sequence, joined
from arctic_rl_core.zorro.forest import pack_forest, plan_forest_micro_batches
from arctic_rl_kernels.layout import ForestLayout

_OPTIONAL_TOKEN_FIELDS = ("advantages", "behaviour_logprobs", "proximal_logprobs", "ref_logprobs", "is_weights", "returns",
                          "old_values")
# Fields that change a loss's objective when present: refused by a loss that would ignore them.
_WEIGHTING_FIELDS = ("is_weights",)


def validate_sequences(sequences: list[Sequence], *, max_context: int, vocab_size: int, field: str = "sequences") -> None:
    """Raise `InvalidRequest` naming the field if any sequence cannot be processed by this model."""
    if not sequences:
        raise InvalidRequest(field, "must hold at least one sequence")
    for i, seq in enumerate(sequences):
        where = f"{field}[{i}]"
        seq.check(where)
        length = len(seq.prompt_ids) + len(seq.response_ids)
        if length > max_context:
            raise InvalidRequest(where, f"is {length} tokens long; the model's context is {max_context}")
        for name in ("prompt_ids", "response_ids"):
            top = int(np.max(getattr(seq, name)))
            if top >= vocab_size:
                raise InvalidRequest(f"{where}.{name}", f"token id {top} is outside the vocabulary ({vocab_size})")


def require_fields(sequences: list[Sequence], fields: tuple[str, ...], why: str, field: str = "sequences") -> None:
    for i, seq in enumerate(sequences):
        for name in fields:
            if getattr(seq, name) is None and not (name == "behaviour_version" and seq.behaviour_versions is not None):
                raise InvalidRequest(f"{field}[{i}].{name}", f"is required by {why}")


def refuse_unread(sequences: list[Sequence], reads: tuple[str, ...], why: str, field: str = "sequences") -> None:
    for i, seq in enumerate(sequences):
        for name in _WEIGHTING_FIELDS:
            if name not in reads and getattr(seq, name) is not None:
                raise InvalidRequest(f"{field}[{i}].{name}", f"is not read by {why}: it would be ignored")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[B, L] for a padded micro-batch; None for a forest."""
    position_ids: torch.Tensor | None
    """[1, N] depth of each packed token, for a forest."""
    layout: ForestLayout | None
    logit_rows: torch.Tensor
    """Flat index into [B * L] of the position predicting each response token."""
    targets: torch.Tensor
    """The response tokens, flattened in sequence order."""
    sequence_ids: list[int]
    """Batch index of each sequence in this micro-batch, in flat order."""
    response_lengths: list[int]
    inputs: LossInputs
    token_paths: list[list[int]] | None
    """A forest's paths: per sequence, the packed index of each of its tokens (None: a padded batch, row by row).
    `token_rows` reads them; kept raw, so a batch no routing touches builds no index tensors."""
    routes: torch.Tensor | None = None
    """[B * L, layers, top_k]: where a sequence carries `routed_experts`, the experts each flat position replays."""
    routes_known: torch.Tensor | None = None
    """[B * L] bool: the positions `routes` holds (the others route natively)."""

    def token_rows(self, j: int) -> torch.Tensor:
        """The flat index into [B * L] of each token (prompt then response) of this micro-batch's sequence `j`."""
        if self.token_paths is None:
            width = self.input_ids.shape[1]
            return torch.arange(j * width, j * width + int(self.attention_mask[j].sum()))
        return torch.tensor(self.token_paths[j], dtype=torch.long)


def group_indices(sequences: list[Sequence]) -> list[int]:
    """Dense group index per sequence; a sequence without a group id is a group of its own."""
    ids: dict[object, int] = {}
    out = []
    for i, seq in enumerate(sequences):
        key = ("group", seq.group_id) if seq.group_id is not None else ("single", i)
        out.append(ids.setdefault(key, len(ids)))
    return out


def plan_micro_batches(sequences: list[Sequence], groups: list[int], token_budget: int) -> list[list[int]]:
    """Partition sequence indices into micro-batches of at most `token_budget` padded tokens, groups kept whole."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)

    def length(i: int) -> int:
        return len(sequences[i].prompt_ids) + len(sequences[i].response_ids)

    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0

    def fits(extra: list[int]) -> bool:
        longest = max([current_max] + [length(i) for i in extra])
        return longest * (len(current) + len(extra)) <= token_budget

    for members in by_group.values():
        if current and not fits(members):
            batches.append(current)
            current, current_max = [], 0
        for i in members:  # a group over the budget is split between sequences
            if current and not fits([i]):
                batches.append(current)
                current, current_max = [], 0
            current.append(i)
            current_max = max(current_max, length(i))
    if current:
        batches.append(current)
    return batches


def _batch_stats(sequences: list[Sequence], groups: list[int], weight_version: int):
    masks = [
        torch.as_tensor(np.asarray(s.loss_mask, dtype=np.float32)) if s.loss_mask is not None
        else torch.ones(len(s.response_ids))
        for s in sequences
    ]
    seq_tokens = torch.stack([m.sum() for m in masks])
    group_tokens = torch.zeros(max(groups) + 1).index_add_(0, torch.tensor(groups), seq_tokens)
    stats = dict(
        seq_tokens=seq_tokens,
        group_tokens=group_tokens,
        num_tokens=float(seq_tokens.sum()),
        num_sequences=int((seq_tokens > 0).sum()),
        num_groups=int((group_tokens > 0).sum()),
        weight_version=weight_version,
    )
    return masks, stats


def _loss_inputs(sequences: list[Sequence], members: list[int], groups: list[int], masks, stats) -> LossInputs:
    lengths = torch.tensor([len(sequences[i].response_ids) for i in members])
    seq_index = torch.repeat_interleave(torch.tensor(members), lengths)
    per_token = {}
    for name in _OPTIONAL_TOKEN_FIELDS:
        values = [getattr(sequences[i], name) for i in members]
        if all(v is not None for v in values):
            per_token[name] = torch.from_numpy(np.concatenate([np.asarray(v, dtype=np.float32) for v in values]))
    # Per token: a response sampled across a weight sync has several versions.
    versions = [sequences[i].behaviour_versions if sequences[i].behaviour_versions is not None
                else None if sequences[i].behaviour_version is None
                else [sequences[i].behaviour_version] * len(sequences[i].response_ids) for i in members]
    if all(v is not None for v in versions):
        per_token["behaviour_version"] = torch.tensor([v for seq in versions for v in seq], dtype=torch.float32)
    return LossInputs(
        loss_mask=torch.cat([masks[i] for i in members]),
        seq_index=seq_index,
        group_index=torch.tensor(groups)[seq_index],
        **stats,
        **per_token,
    )


def batch_loss_inputs(sequences: list[Sequence], weight_version: int) -> LossInputs:
    """The loss inputs of a whole batch as one micro-batch: a loss evaluated on log-probs computed elsewhere (a
    forward-only call's loss value) sees what `fwd_bwd` would give it."""
    groups = group_indices(sequences)
    masks, stats = _batch_stats(sequences, groups, weight_version)
    return _loss_inputs(sequences, list(range(len(sequences))), groups, masks, stats)


def _padded(sequences: list[Sequence], members: list[int], pad_id: int) -> dict:
    width = max(len(sequences[i].prompt_ids) + len(sequences[i].response_ids) for i in members)
    input_ids = torch.full((len(members), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(members), width), dtype=torch.long)
    rows = []
    for b, i in enumerate(members):
        seq = sequences[i]
        p, r = len(seq.prompt_ids), len(seq.response_ids)
        input_ids[b, : p + r] = torch.from_numpy(joined(seq.prompt_ids, seq.response_ids))
        attention_mask[b, : p + r] = 1
        rows.append(torch.arange(p - 1, p + r - 1) + b * width)
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=None, layout=None, logit_rows=torch.cat(rows),
                token_paths=None, **_routes(sequences, members, lambda b: torch.arange(b * width, (b + 1) * width),
                                            len(members) * width))


def _forest(sequences: list[Sequence], full: list[list[int]], members: list[int], min_shared_tokens: int,
            routes: list[np.ndarray | None] | None) -> dict:
    forest = pack_forest([full[i] for i in members], min_shared_tokens,
                         routes=None if routes is None else [routes[i] for i in members])
    rows = []
    for i, path in zip(members, forest.paths):
        p, r = len(sequences[i].prompt_ids), len(sequences[i].response_ids)
        rows.extend(path[p - 1 : p + r - 1])
    return dict(
        input_ids=torch.tensor([forest.tokens]),
        attention_mask=None,
        position_ids=torch.tensor([forest.position_ids]),
        layout=forest.layout,
        logit_rows=torch.tensor(rows, dtype=torch.long),
        token_paths=forest.paths,
        **_routes(sequences, members, lambda b: torch.tensor(forest.paths[b], dtype=torch.long), len(forest.tokens)),
    )


def _routes(sequences: list[Sequence], members: list[int], rows_of, flat: int) -> dict:
    """The members' routing records scattered to their flat positions (`rows_of(b)`: member b's, from its first
    token; a shared prefix's rows agree: the forest shares only tokens whose records do)."""
    records = [(sequences[i].routed_experts, rows_of(b)) for b, i in enumerate(members)
               if sequences[i].routed_experts is not None]
    if not records:
        return {}
    first = records[0][0]
    routes = torch.zeros(flat, first.layers, first.top_k, dtype=torch.long)
    known = torch.zeros(flat, dtype=torch.bool)
    for record, rows in records:
        array = torch.from_numpy(record.array())
        routes[rows[: len(array)]] = array
        known[rows[: len(array)]] = True
    return dict(routes=routes, routes_known=known)


def build_micro_batches(
    sequences: list[Sequence], *, token_budget: int, weight_version: int, pad_id: int = 0,
    forest: bool = False, min_shared_tokens: int = 1,
) -> list[MicroBatch]:
    """Micro-batches of `sequences`: padded, or packed as prefix forests when `forest` is set."""
    groups = group_indices(sequences)
    masks, stats = _batch_stats(sequences, groups, weight_version)
    if forest:
        # The forest is a trie of Python token lists: its sort and prefix matching run on them.
        full = [joined(s.prompt_ids, s.response_ids).tolist() for s in sequences]
        routes = None if all(s.routed_experts is None for s in sequences) else [
            None if s.routed_experts is None else s.routed_experts.array().reshape(s.routed_experts.tokens, -1)
            for s in sequences]
        plan = plan_forest_micro_batches(full, token_budget, min_shared_tokens)
    else:
        plan = plan_micro_batches(sequences, groups, token_budget)
    out = []
    for members in plan:
        tensors = _forest(sequences, full, members, min_shared_tokens, routes) if forest else _padded(sequences, members, pad_id)
        out.append(
            MicroBatch(
                **tensors,
                targets=torch.from_numpy(np.concatenate([np.asarray(sequences[i].response_ids, dtype=np.int64)
                                                         for i in members])),
                sequence_ids=list(members),
                response_lengths=[len(sequences[i].response_ids) for i in members],
                inputs=_loss_inputs(sequences, members, groups, masks, stats),
            )
        )
    return out
