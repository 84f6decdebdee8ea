"""Translating between verl's batches (TensorDict, jagged rows of prompt+response) and the training API.

verl's engine contract puts log-probs in full-row layout: position t of a row holds
log p(x[t+1] | x[..t]), so a response of length r after a prompt of length p sits at
[p-1, p-1+r). The training API speaks response tokens only.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from arctic_rl_core.types import LossSpec, RoutedExperts, Sequence

def _dro(actor, low, high):
    beta = actor.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={beta!r}: DRO needs a positive value")
    return {"dro_beta": beta}


def _bypass(actor, low, high):
    """verl's bypass mode, where old log-probs are the rollout's: PPO's clip on that ratio, or REINFORCE with
    truncated token-level importance weights (CISPO's weight with bounds 0 and the threshold). Rejection sampling,
    sequence-level weights and batch normalisation are statistics of verl's micro-batch: refused."""
    correction, where = actor.policy_loss.rollout_correction, "actor_rollout_ref.actor.policy_loss.rollout_correction"
    for key in ("rollout_rs", "rollout_rs_threshold"):
        if correction.get(key) is not None:
            raise ValueError(f"{where}.{key}={correction.get(key)!r}: arctic_rl serves bypass_mode without rejection "
                             "sampling")
    if correction.get("rollout_is_batch_normalize", False):
        raise ValueError(f"{where}.rollout_is_batch_normalize=True: the normalisation is over verl's micro-batch")
    loss_type, level = correction.get("loss_type", "ppo_clip"), correction.get("rollout_is")
    if loss_type == "ppo_clip":
        return {"c_clip": actor.clip_ratio_c}
    if loss_type != "reinforce":
        raise ValueError(f"{where}.loss_type={loss_type!r}: arctic_rl serves ppo_clip, reinforce")
    if level is None:
        return {"use_cispo_loss": True, "is_weight_clip_min": 1.0, "is_weight_clip_max": 1.0}
    threshold = correction.get("rollout_is_threshold", 2.0)
    if level != "token" or not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
        raise ValueError(f"{where}.rollout_is={level!r}, rollout_is_threshold={threshold!r}: arctic_rl serves "
                         "token-level weights truncated at one number")
    return {"use_cispo_loss": True, "is_weight_clip_min": 0.0, "is_weight_clip_max": float(threshold)}


# verl's policy_loss.loss_mode -> the GRPO loss's settings beside the clip range (low, high): PPO's clip with dual clip,
# PPO's clip on GSPO's sequence ratio, CISPO's clipped stopped weight, GPG's plain -A logp (a weight of exactly 1),
# SAPO's soft gate, DRO's quadratic penalty, DPPO's divergence-masked truncated gradient, bypass mode.
# clip_cov and kl_cov pick tokens by a covariance over verl's micro-batch (clip_cov at random): not served.
LOSS_MODES = {
    "vanilla": lambda actor, low, high: {"c_clip": actor.clip_ratio_c},
    "gspo": lambda actor, low, high: {"importance_ratio": "sequence"},
    "cispo": lambda actor, low, high: {"use_cispo_loss": True, "is_weight_clip_min": max(0.0, 1 - low),
                                       "is_weight_clip_max": 1 + high},
    "gpg": lambda actor, low, high: {"use_cispo_loss": True, "is_weight_clip_min": 1.0, "is_weight_clip_max": 1.0},
    # verl's SAPO aggregates its gated term per sequence whatever loss_agg_mode says (which its KL and entropy use).
    "sapo": lambda actor, low, high: {"sapo_tau_pos": actor.tau_pos, "sapo_tau_neg": actor.tau_neg,
                                      "loss_agg_mode": "seq-mean-token-mean"},
    "dro": _dro,
    "dppo_tv": lambda actor, low, high: {"dppo_divergence": "tv", "c_clip": actor.clip_ratio_c},
    "dppo_kl": lambda actor, low, high: {"dppo_divergence": "binary_kl", "c_clip": actor.clip_ratio_c},
    "bypass_mode": _bypass,
}
# verl's kl_loss_type -> Arctic RL's (the same formulas; k3 with the same clamps). Not the straight-through "+" kinds.
KL_TYPES = {"kl": "k1", "k1": "k1", "low_var_kl": "low_var_kl", "k3": "k3"}
# verl's loss_agg_mode -> Arctic RL's GRPO aggregation (the same normalisations at one rank).
AGGREGATION = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
               "seq-mean-token-sum": "seq-mean-token-sum", "token-sum": "token-sum",
               "seq-mean-token-sum-norm": "seq-mean-token-sum-norm"}


def _rows(tensor: torch.Tensor, dtype=None) -> list[np.ndarray]:
    """A batch's rows as numpy views: for verl's jagged tensors, slices of one conversion of the values (a torch
    `unbind` per row costs more than everything else the adapter does to a batch)."""
    if not tensor.is_nested:
        return list(tensor.cpu().numpy() if dtype is None else tensor.to(dtype).cpu().numpy())
    values = tensor.values() if dtype is None else tensor.values().to(dtype)
    values, offsets = values.cpu().numpy(), tensor.offsets().cpu().numpy()
    lengths = tensor.lengths()
    ends = offsets[1:] if lengths is None else offsets[:-1] + lengths.cpu().numpy()
    return [values[start:end] for start, end in zip(offsets[:-1], ends)]


def _row_lengths(tensor: torch.Tensor) -> np.ndarray:
    if not tensor.is_nested:
        return np.full(tensor.shape[0], tensor.shape[1])
    lengths = tensor.lengths()
    return np.diff(tensor.offsets().cpu().numpy()) if lengths is None else lengths.cpu().numpy()


def _response_rows(data: TensorDict, key: str) -> list[np.ndarray] | None:
    return _rows(data[key], torch.float32) if key in data.keys() else None


def _routes(data: TensorDict) -> list[RoutedExperts | None]:
    """Each row's `routed_experts` (verl's R3 rollout or R2 old-log-prob pass: [tokens, layers, top_k] per row, from
    the row's first token), less the trailing rows verl zero-fills past what the engine recorded (with top-k >= 2 an
    all-zero row names one expert twice: it is no route)."""
    out = []
    for row in _rows(data["routed_experts"]):
        routes = np.asarray(row).astype(np.int64)
        if routes.shape[-1] > 1:
            recorded = np.flatnonzero(routes.reshape(len(routes), -1).any(axis=1))
            routes = routes[: int(recorded[-1]) + 1 if recorded.size else 0]
        out.append(RoutedExperts.of(routes) if len(routes) else None)
    return out


def sequences_from_batch(data: TensorDict, critic: bool = False, routes: bool = False) -> list[Sequence]:
    """One `Sequence` per row: prompt and response ids, the GRPO group (`uid`), and the per-token
    fields verl's actor update carries (advantages, old log-probs as behaviour log-probs, the reference's
    log-probs, mask); for the critic's update (`critic`), its returns and the values it was scored with; with
    `routes` (verl's `router_replay.mode` R2 or R3), each row's routed experts where the batch has them.
    Rows are numpy views of the batch's tensors, which the client sends without copying into lists."""
    if data["prompts"].dim() != 2 or "attention_mask" in data.keys() and not data["prompts"].is_nested:

        raise ValueError("arctic_rl expects verl's no-padding batches (jagged rows); padded batches are not supported")
    prompts, responses = _rows(data["prompts"]), _rows(data["responses"])
    uids = list(data["uid"]) if "uid" in data.keys() else [None] * len(prompts)
    mask = _response_rows(data, "response_mask")
    advantages = _response_rows(data, "advantages")
    old = _response_rows(data, "old_log_probs")
    ref = _response_rows(data, "ref_log_prob")
    # verl's rollout correction (decoupled mode): truncated pi_old / pi_rollout, computed by verl's trainer.
    is_weights = _response_rows(data, "rollout_is_weights")
    returns = _response_rows(data, "returns") if critic else None
    old_values = _response_rows(data, "values") if critic else None
    routed = _routes(data) if routes and "routed_experts" in data.keys() else [None] * len(prompts)
    return [
        Sequence(
            prompt_ids=p, response_ids=r, group_id=None if uid is None else str(uid),
            loss_mask=None if mask is None else mask[i],
            advantages=None if advantages is None or critic else advantages[i],
            behaviour_logprobs=None if old is None or critic else old[i],
            ref_logprobs=None if ref is None or critic else ref[i],
            is_weights=None if is_weights is None or critic else is_weights[i],
            returns=None if returns is None else returns[i],
            old_values=None if old_values is None else old_values[i],
            routed_experts=routed[i],
        )
        for i, (p, r, uid) in enumerate(zip(prompts, responses, uids))
    ]


def full_row_layout(per_response: list[list[float]], data: TensorDict) -> torch.Tensor:
    """Response log-probs (or entropies) placed where verl reads them in a jagged full-row tensor."""
    prompt_lengths, response_lengths = _row_lengths(data["prompts"]), _row_lengths(data["responses"])
    offsets = np.concatenate([[0], np.cumsum(prompt_lengths + response_lengths)])
    flat = np.zeros(offsets[-1], dtype=np.float32)
    for values, start, p, r in zip(per_response, offsets, prompt_lengths, response_lengths):
        flat[start + p - 1 : start + p - 1 + r] = values
    # The jagged tensor is a view of the one array: no per-row tensors, no copy.
    return torch.nested.nested_tensor_from_jagged(torch.from_numpy(flat), offsets=torch.from_numpy(offsets))


def full_row_routes(routes: list[RoutedExperts], data: TensorDict) -> torch.Tensor:
    """The routing a log-prob pass took (R2), as verl's engines return `routed_experts`: a jagged [rows, tokens,
    layers, top_k] int16 tensor, each row its prompt and response tokens."""
    rows = [torch.from_numpy(r.array().astype(np.int16)) for r in routes]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def batch_temperature(data: TensorDict) -> float:
    value = data["temperature"] if "temperature" in data.keys() else 1.0
    if isinstance(value, torch.Tensor):
        distinct = value.float().unique()
        if distinct.numel() != 1:
            raise ValueError("arctic_rl needs one sampling temperature per batch")
        return float(distinct.item())
    return float(value)


def loss_spec(actor_config, temperature: float) -> LossSpec:
    """Arctic RL's GRPO loss with the settings of verl's policy loss (`LOSS_MODES`)."""
    mode = actor_config.policy_loss.loss_mode
    if mode not in LOSS_MODES and mode != "geo_mean":
        why = (" (it picks tokens by a covariance over verl's micro-batch, which the backend does not see)"
               if mode in ("clip_cov", "kl_cov") else "")
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}{why}: arctic_rl serves "
                         f"{', '.join(LOSS_MODES)}, geo_mean")
    agg = AGGREGATION.get(actor_config.loss_agg_mode)
    if agg is None:
        raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={actor_config.loss_agg_mode!r} is not supported; "
                         f"use one of {', '.join(AGGREGATION)}")
    scale = getattr(actor_config, "loss_scale_factor", None)
    if agg == "seq-mean-token-sum-norm" and scale is None:
        # verl then divides by the padded width of each micro-batch, which depends on how verl batches.
        raise ValueError("actor_rollout_ref.actor.loss_agg_mode='seq-mean-token-sum-norm' needs "
                         "actor_rollout_ref.actor.loss_scale_factor (e.g. data.max_response_length): without it verl "
                         "divides by each micro-batch's padded width, which depends on its batching")
    low = actor_config.clip_ratio_low if actor_config.clip_ratio_low is not None else actor_config.clip_ratio
    high = actor_config.clip_ratio_high if actor_config.clip_ratio_high is not None else actor_config.clip_ratio
    post = [{"name": "apply_temperature", "config": {"temperature": temperature}}] if temperature != 1.0 else []
    if mode == "geo_mean":
        # GMPO is its own sequence-level objective: verl adds its entropy and KL terms token by token to it, which
        # the `gmpo` loss does not carry.
        if actor_config.entropy_coeff or actor_config.use_kl_loss:
            raise ValueError("actor_rollout_ref.actor.policy_loss.loss_mode='geo_mean' with entropy_coeff or "
                             "use_kl_loss: arctic_rl serves GMPO alone")
        return LossSpec(name="gmpo", config={"eps_clip": low, "eps_clip_higher": high}, post=post)
    config = {"eps_clip": low, "eps_clip_higher": high, "loss_agg_mode": agg, "entropy_coeff": actor_config.entropy_coeff,
              "entropy_agg_mode": agg, "kl_agg_mode": agg, **LOSS_MODES[mode](actor_config, low, high)}
    if agg == "seq-mean-token-sum-norm":
        config["loss_scale_factor"] = float(scale)
    if actor_config.use_kl_loss:
        # Against the job's reference model (verl's ref worker on arctic_rl: log_probs(source="reference")).
        kind = KL_TYPES.get(actor_config.kl_loss_type)
        if kind is None:
            raise ValueError(f"actor_rollout_ref.actor.kl_loss_type={actor_config.kl_loss_type!r} is not supported; use "
                             f"one of {', '.join(KL_TYPES)}")
        config.update(kl_loss_coef=actor_config.kl_loss_coef, kl_loss_type=kind)
    return LossSpec(name="grpo", config=config, post=post)


def value_loss_spec(critic_config) -> LossSpec:
    """Arctic RL's `value` loss with the settings of verl's critic (its `compute_value_loss`)."""
    agg = AGGREGATION.get(critic_config.loss_agg_mode)
    if agg is None or agg == "seq-mean-token-sum-norm":
        raise ValueError(f"critic.loss_agg_mode={critic_config.loss_agg_mode!r} is not supported; use one of "
                         f"{', '.join(AGGREGATION)}")
    if getattr(critic_config, "loss_scale_factor", None) is not None:
        raise ValueError("critic.loss_scale_factor: arctic_rl aggregates without a scale factor; leave it null")
    return LossSpec(name="value", config={"cliprange_value": critic_config.cliprange_value, "loss_agg_mode": agg})
