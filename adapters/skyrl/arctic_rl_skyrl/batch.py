"""Translating between SkyRL's `TrainingInputBatch` and the training API's `Sequence`s.

SkyRL lays a batch out left-padded: row i is `sequences[i][attention_mask[i]]`, its last
`response_mask[i].sum()` tokens the response; response-level tensors (`loss_mask`,
`advantages`, log-probs) are right-aligned in `[B, response_length]`, so a row's response
values are its last r entries. The training API speaks response tokens only.

With router replay (R3) the batch also carries each row's routing as SkyRL's generator recorded it:
`rollout_expert_indices`, a packed tensor whose segment i holds a `[tokens, layers, top_k]` row per real token of
row i, of which those `router_padding_mask` leaves unmarked (a prefix: vLLM never forwards the last sampled token)
were recorded, the rest placeholders.
"""

from __future__ import annotations

import numpy as np
import torch

from arctic_rl_core.types import RoutedExperts, Sequence


def group_ids(data, boundaries: list[tuple[int, int]] | None = None) -> list[str | None]:
    """The GRPO group of each row: SkyRL's `uids` while the batch has them, else its per-prompt boundaries
    (the trainer drops `uids` before training); a row in neither is a group of its own."""
    uids = data.metadata.get("uids") if data.metadata else None
    if uids is not None and len(uids) == len(data):
        return [str(u) for u in uids]
    groups: list[str | None] = [None] * len(data)
    for index, (start, end) in enumerate(boundaries or []):
        for row in range(max(start, 0), min(end, len(data))):
            groups[row] = f"prompt-{index}"
    return groups


def _response(values: torch.Tensor | None, row: int, length: int) -> np.ndarray | None:
    return None if values is None else values[row, values.shape[1] - length:].float().cpu().numpy()


def response_lengths(data) -> list[int]:
    return data["response_mask"].sum(dim=1).long().tolist()


def routes(data) -> list[RoutedExperts]:
    """Each row's recorded routing (R3), from its first real token to the last one recorded."""
    if data.get("rollout_expert_indices") is None or data.get("router_padding_mask") is None:
        raise ValueError("SkyRL's batch carries no rollout_expert_indices: its generator recorded no routing (set "
                         "generator.inference_engine.enable_return_routed_experts=true)")
    packed, unrecorded = data["rollout_expert_indices"], data["router_padding_mask"].bool()
    attention = data["attention_mask"].bool()
    return [RoutedExperts.of(packed[row][:int((attention[row] & ~unrecorded[row]).sum())].cpu().numpy())
            for row in range(len(attention))]


def sequences_from_batch(data, groups: list[str | None], behaviour_key: str | None = None,
                         lengths: list[int] | None = None, critic: bool = False,
                         replay: bool = False) -> list[Sequence]:
    """One `Sequence` per row, with the advantages (already scaled by SkyRL's loss reduction), loss mask,
    reference log-probs (SkyRL's `base_action_log_probs`) and, when `behaviour_key` names one, the log-probs
    the PPO ratio is taken against; for the critic's update (`critic`), the returns and the values the batch was
    scored with instead. `lengths`: the rows' response lengths, for a batch without its `response_mask`.
    `replay`: each row's recorded routing too (`routes`)."""
    sequences, attention = data["sequences"], data["attention_mask"].bool()
    lengths = response_lengths(data) if lengths is None else lengths
    recorded = routes(data) if replay else [None] * len(lengths)
    loss_mask = data.get("loss_mask")
    if critic:
        fields = {"returns": data.get("returns"), "old_values": data.get("values")}
    else:
        fields = {"advantages": data.get("advantages"), "ref_logprobs": data.get("base_action_log_probs"),
                  "behaviour_logprobs": data.get(behaviour_key) if behaviour_key else None}
    out = []
    for row, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"row {row} of SkyRL's batch has an empty response")
        tokens = sequences[row][attention[row]].cpu().numpy()
        out.append(Sequence(
            prompt_ids=tokens[:-length], response_ids=tokens[-length:], group_id=groups[row],
            loss_mask=_response(loss_mask, row, length), routed_experts=recorded[row],
            **{name: _response(values, row, length) for name, values in fields.items()},
        ))
    return out


def right_aligned(per_response: list[list[float]], width: int) -> torch.Tensor:
    """Response values as SkyRL holds them: `[B, width]`, each row's values in its last entries."""
    out = torch.zeros(len(per_response), width, dtype=torch.float32)
    for row, values in enumerate(per_response):
        if values:
            out[row, width - len(values):] = torch.tensor(values, dtype=torch.float32)
    return out
