"""Tinker's loss functions as losses of Arctic RL's registry.

Tinker's losses are sums over every position of every datum (its docs: "we sum the token-level losses over the
sequence length"), with the sampler's log-probs in `logprobs` and per-position `advantages` (zero on prompt
positions). Each maps onto a registered loss aggregated with `token-sum` over all positions:

  cross_entropy        -sum(weights * logp)                     grpo's GPG form (-A logp) with A = weights
  importance_sampling  -sum(exp(logp - q) * A)                  importance_sampling
  ppo                  -sum(min(r A, clip(r, low, high) A))     grpo, eps_clip = 1 - low, eps_clip_higher = high - 1
  cispo                -sum(sg(clip(r, low, high)) logp A)      grpo's CISPO form, is_weight_clip = (low, high)
  dro                  -sum(logp A - beta/2 (logp - q)^2)       grpo's DRO form, dro_beta = beta
  gspo                 -sum(min(s A, clip(s, low, high) A))     grpo, importance_ratio = sequence, the ppo clip
                       s = exp(sg(mean over M of (logp - q)) + logp - sg(logp)), M the datum's sequence_ratio_mask

with r = exp(logp - q), q the sampler's log-probs, low/high `clip_low_threshold`/`clip_high_threshold` (ratio
bounds; 0.8 and 1.2 unless given, except for gspo, whose bounds must be given). gspo's positions outside M train
through `loss_mask`, so they must have no advantage (as the sampled tokens' mask leaves the prompt's); the
registry clamps the sequence log-ratio at 10, a ratio of e^10 no data near on-policy reaches. cross_entropy's
weights travel as advantages because that is what they are to the gradient: any real weight (the SDK's
forward_backward_custom sends -dC/dlogp) is exact. stable_reinforce needs sampling provenance the server does not
record, and custom losses run client-side: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import LossSpec, Sequence


@dataclass(frozen=True)
class TinkerLoss:
    registry_name: str
    inputs: dict[str, str]
    """Tinker's loss_fn_inputs key -> the Sequence field it fills (besides target_tokens)."""
    settings: dict
    clipped: bool = False
    """Reads clip_low_threshold / clip_high_threshold."""


_SUM = {"loss_agg_mode": "token-sum"}
_RL = {"logprobs": "behaviour_logprobs", "advantages": "advantages"}
LOSSES = {
    "cross_entropy": TinkerLoss("grpo", {"weights": "advantages"},
                                {**_SUM, "use_cispo_loss": True, "is_weight_clip_min": 1.0, "is_weight_clip_max": 1.0}),
    "importance_sampling": TinkerLoss("importance_sampling", _RL, _SUM),
    "ppo": TinkerLoss("grpo", _RL, _SUM, clipped=True),
    "cispo": TinkerLoss("grpo", _RL, {**_SUM, "use_cispo_loss": True}, clipped=True),
    "dro": TinkerLoss("grpo", _RL, _SUM),
    "gspo": TinkerLoss("grpo", {**_RL, "sequence_ratio_mask": "loss_mask"}, {**_SUM, "importance_ratio": "sequence"},
                       clipped=True),
}
_REFUSED = {
    "stable_reinforce": "it needs sampling provenance this server does not record",
    "custom": "custom losses run in the SDK (forward_backward_custom), which sends cross_entropy",
}
DEFAULT_CLIP = (0.8, 1.2)


def loss_spec(name: str, config: dict[str, float | str]) -> LossSpec:
    """The registry loss for Tinker's `name` with `config` (loss_fn_config), or a refusal naming the field."""
    if name in _REFUSED:
        raise InvalidRequest("loss_fn", f"{name!r} is not supported: {_REFUSED[name]}")
    loss = LOSSES.get(name)
    if loss is None:
        raise InvalidRequest("loss_fn", f"{name!r} is not a Tinker loss; supported: {', '.join(LOSSES)}")
    known = {"clip_low_threshold", "clip_high_threshold"} if loss.clipped else {"beta"} if name == "dro" else set()
    for key, value in config.items():
        if key not in known:
            raise InvalidRequest(f"loss_fn_config.{key}", f"is not a setting of {name}"
                                 + (f" (it takes {', '.join(sorted(known))})" if known else " (it takes none)"))
        if not isinstance(value, float) or not np.isfinite(value):
            raise InvalidRequest(f"loss_fn_config.{key}", f"must be a finite number, got {value!r}")
    settings = dict(loss.settings)
    if name == "gspo":  # Tinker's defaults for it are not published: what is not given is not guessed
        for key in ("clip_low_threshold", "clip_high_threshold"):
            if key not in config:
                raise InvalidRequest(f"loss_fn_config.{key}", "is required by gspo")
    if loss.clipped:
        low = config.get("clip_low_threshold", DEFAULT_CLIP[0])
        high = config.get("clip_high_threshold", DEFAULT_CLIP[1])
        if not 0 <= low <= 1:
            raise InvalidRequest("loss_fn_config.clip_low_threshold", f"must be in [0, 1] (a ratio bound), got {low}")
        if high < 1:
            raise InvalidRequest("loss_fn_config.clip_high_threshold", f"must be at least 1 (a ratio bound), got {high}")
        if name in ("ppo", "gspo"):
            settings.update(eps_clip=1.0 - low, eps_clip_higher=high - 1.0)
        else:
            settings.update(is_weight_clip_min=low, is_weight_clip_max=high)
    if name == "dro":
        if "beta" not in config:
            raise InvalidRequest("loss_fn_config.beta", "is required by dro")
        if config["beta"] <= 0:
            raise InvalidRequest("loss_fn_config.beta", f"must be positive, got {config['beta']}")
        settings["dro_beta"] = config["beta"]
    return LossSpec(name=loss.registry_name, config=settings)


def with_loss_inputs(name: str, sequences: list[Sequence], inputs: list[dict[str, np.ndarray]]) -> list[Sequence]:
    """The datums' sequences carrying the fields `name` reads; a missing input is refused by its key."""
    loss = LOSSES[name]
    filled = []
    for i, (seq, arrays) in enumerate(zip(sequences, inputs)):
        fields = {}
        for key, field in loss.inputs.items():
            if key not in arrays:
                raise InvalidRequest(f"data[{i}].loss_fn_inputs.{key}", f"is required by {name}")
            fields[field] = arrays[key].astype(np.float32)
        unread = sorted(set(arrays) - set(loss.inputs) - {"target_tokens"})
        if unread:
            raise InvalidRequest(f"data[{i}].loss_fn_inputs.{unread[0]}", f"is not read by {name}: it would be ignored")
        if name == "gspo":
            fields["loss_mask"] = in_ratio = (fields["loss_mask"] != 0).astype(np.float32)
            if not in_ratio.any():
                raise InvalidRequest(f"data[{i}].loss_fn_inputs.sequence_ratio_mask", "marks no position: the "
                                     "sequence ratio is a mean over the marked ones")
            if (fields["advantages"][in_ratio == 0] != 0).any():
                raise InvalidRequest(f"data[{i}].loss_fn_inputs.advantages", "is non-zero at a position "
                                     "sequence_ratio_mask leaves out: this server trains only the marked positions")
        filled.append(Sequence(prompt_ids=seq.prompt_ids, response_ids=seq.response_ids, **fields))
    return filled
