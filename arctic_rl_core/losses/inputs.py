"""What a loss sees: per-response-token tensors, flattened over a micro-batch.

Token t of the flattened layout is one response token; `seq_index[t]` and
`group_index[t]` say which sequence and GRPO group of the *whole* `fwd_bwd`
batch it belongs to. Denominators (`num_tokens`, `seq_tokens`, ...) are over
the whole batch, so a loss normalised with them sums exactly over
micro-batches, and gradients do not depend on how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "prompt-mean", "token-sum"]
ScaledAggregationMode = Literal[AggregationMode, "seq-mean-token-sum-norm"]
"""With `seq-mean-token-sum-norm`: seq-mean-token-sum divided by a constant (verl's `loss_scale_factor`; Dr. GRPO's)."""


@dataclass
class LossInputs:
    loss_mask: torch.Tensor
    seq_index: torch.Tensor
    group_index: torch.Tensor
    seq_tokens: torch.Tensor
    """Masked token count of every sequence in the batch, indexed by `seq_index`."""
    group_tokens: torch.Tensor
    """Masked token count of every group in the batch, indexed by `group_index`."""
    num_tokens: float
    num_sequences: int
    """Sequences with at least one unmasked token."""
    num_groups: int
    """Groups with at least one unmasked token."""
    weight_version: int
    """The trainer's current weight version (for staleness-aware losses)."""
    advantages: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    behaviour_version: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None

    def token_weights(self, mode: ScaledAggregationMode, scale_factor: float | None = None) -> torch.Tensor:
        """Per-token weights w with loss = sum(w * token_loss) for aggregation `mode` (`scale_factor`: the
        constant `seq-mean-token-sum-norm` divides by)."""
        mask = self.loss_mask
        if mode == "seq-mean-token-sum-norm":
            if scale_factor is None:
                raise ValueError("seq-mean-token-sum-norm needs a scale factor")
            return mask / max(self.num_sequences, 1) / scale_factor
        if mode == "token-mean":
            return mask / max(self.num_tokens, 1.0)
        if mode == "seq-mean-token-mean":
            per_seq = self.seq_tokens[self.seq_index].clamp(min=1.0)
            return mask / per_seq / max(self.num_sequences, 1)
        if mode == "seq-mean-token-sum":
            return mask / max(self.num_sequences, 1)
        if mode == "prompt-mean":
            per_group = self.group_tokens[self.group_index].clamp(min=1.0)
            return mask / per_group / max(self.num_groups, 1)
        if mode == "token-sum":
            # For callers whose per-token values already carry their normalisation (SkyRL scales advantages).
            return mask
        raise ValueError(f"unknown aggregation mode {mode!r}")

    def aggregate(self, token_values: torch.Tensor, mode: ScaledAggregationMode,
                  scale_factor: float | None = None) -> torch.Tensor:
        return (token_values * self.token_weights(mode, scale_factor)).sum()

    def token_mean(self, token_values: torch.Tensor) -> torch.Tensor:
        """Batch-wide token mean: the form every additive metric takes."""
        return self.aggregate(token_values.detach().float(), "token-mean")
