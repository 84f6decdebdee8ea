"""Every decoder-only causal-LM family in the installed transformers, at tiny random size, with
its defaults and with its optional features on (sliding windows, softcaps, logit scaling):
either refused at load by the engine's checks, naming why, or exact against the model's own
forward of each sequence alone (eager attention, its own head).

`python -m tests.model_sweep > docs/models.md` writes the table; tests/test_model_families.py
runs the sweep and checks that table is current.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import re
import warnings
from dataclasses import dataclass

import torch

from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.engines.response_logits import ResponseLogits
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.determinism import inference_behaviour, without_dropout
from arctic_rl_core.models.exactness import check_exactness, check_features
from arctic_rl_core.models.head import output_head
from arctic_rl_core.types import Sequence
from arctic_rl_core.zorro.attention import ZORRO_ATTENTION

VOCAB = 96
BACKEND = "math"
"""The split-attention primitives the sweep runs ZoRRo on: the tiled matmuls, exact to fp32 rounding on every CPU.
What is judged here is each family's integration (the layout reaching every attention, its score rules, its head);
the faster kernels' own rounding is judged by their parity tests (tests/test_split_attention.py). On an Intel Xeon
(2026-11-26) ATen's CPU flash kernels put CTRL's FFN gradients 1.2e-5 off fp64 where its own fp32 forward is 3.7e-7
off, over this sweep's bound, while an AMD EPYC stayed under it: with them the table depended on the CPU."""
_MAX_PARAMETERS = 5_000_000
LOGPROB_TOLERANCE = 2e-6
GRAD_TOLERANCE = 1e-5
_SURE = 0.5
"""An exact row whose errors use more of the direct bound than this is also measured against fp64."""

# Small sizes for whatever of these a family's config has; the rest keep their defaults.
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.1,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rotary_dim=8,
    attention_dropout=0.0, hidden_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16, linear_head_dim=8, linear_num_heads=4,
    n_embd=32, n_layer=2, n_head=4, n_positions=128, d_model=32, n_heads=4, num_layers=2, ffn_dim=64,
)
_FEATURES = {
    "window 3": dict(sliding_window=3, use_sliding_window=True, max_window_layers=0),
    "attention softcap": dict(attn_logit_softcapping=2.0),
    "final softcap": dict(final_logit_softcapping=3.0),
    "logit scale": dict(logit_scale=0.5, logits_scaling=4.0, lm_head_multiplier=0.5),
}


@dataclass
class Row:
    model_type: str
    variant: str
    outcome: str
    """`exact`, `refused` or `not built`; `wrong` or `error` are failures (accepted at load, then wrong or failing)."""
    detail: str = ""
    logprob_error: float | None = None
    grad_error: float | None = None
    """Worst parameter's relative gradient error (errors under 1e-6 of the whole gradient's norm not counted)."""
    whole_grad_error: float | None = None
    """The whole gradient's relative error."""
    bound_used: float | None = None
    """Of an exact row, the largest fraction of its bound its errors used (1 would be the edge of `wrong`)."""
    judged_by_fp64: bool = False
    """An exact row past the direct tolerance, held to the model's own fp32 error against fp64."""


def decoder_families() -> list[str]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def decoder_only(model_type: str) -> bool:
        try:
            return not CONFIG_MAPPING[model_type]().is_encoder_decoder
        except Exception:  # noqa: BLE001 -- a config without defaults is tried (and listed) anyway
            return True

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING and decoder_only(t))


def tiny_config(model_type: str, variant: str, **overrides):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls()  # a config that needs arguments fails here and is listed as not built
    wanted = {**_SIZES, **_FEATURES.get(variant, {}), **overrides}
    derived = {k for k in wanted if isinstance(getattr(cls, k, None), property)}  # computed from other fields
    kwargs = {k: v for k, v in wanted.items() if hasattr(defaults, k) and k not in derived}
    if variant != "default" and not any(hasattr(defaults, k) for k in _FEATURES[variant]):
        return None
    config = without_dropout(cls(**kwargs))
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) != config.num_hidden_layers:
        config.layer_types = types[: config.num_hidden_layers]
    return config


def _sequences(rng: random.Random) -> list[Sequence]:
    ids = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    prompt, other = ids(7), ids(4)
    seqs = [Sequence(prompt_ids=prompt, response_ids=ids(n)) for n in (5, 1, 8)]
    seqs += [Sequence(prompt_ids=other, response_ids=ids(3)), Sequence(prompt_ids=ids(1), response_ids=ids(2))]
    for s in seqs:
        s.advantages = [rng.uniform(-1, 1) for _ in s.response_ids]
    return seqs


def _weighted(lp: torch.Tensor, seqs, order) -> torch.Tensor:
    return sum((lp_i * torch.tensor(seqs[i].advantages, dtype=lp_i.dtype)).sum() for i, lp_i in zip(order, lp))


def _ours(model, seqs) -> tuple[torch.Tensor, dict]:
    """The engine's path: one packed forest through ZoRRo's attention and the family's head."""
    wrapper = ResponseLogits(model, model, output_head(model.config), BACKEND)
    [mb] = build_micro_batches(seqs, token_budget=10**9, weight_version=0, forest=True)
    logits = wrapper(mb.input_ids, mb.logit_rows, mb.attention_mask, mb.position_ids, mb.layout)
    lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets[:, None])[:, 0]
    parts = dict(zip(mb.sequence_ids, torch.split(lp, mb.response_lengths)))
    model.zero_grad(set_to_none=True)
    _weighted([parts[i] for i in range(len(seqs))], seqs, range(len(seqs))).backward()
    return torch.cat([parts[i] for i in range(len(seqs))]).detach(), _grads(model)


def _own(model, seqs) -> tuple[torch.Tensor, dict]:
    """The model's own forward of each sequence alone."""
    model.zero_grad(set_to_none=True)
    lps = []
    for s in seqs:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids, use_cache=False).logits[0, len(s.prompt_ids) - 1 : -1]
        lps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0])
    _weighted(lps, seqs, range(len(seqs))).backward()
    return torch.cat(lps).detach(), _grads(model)


def _grads(model) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(ours: dict, own: dict) -> float:
    """Worst relative error over parameters. An error under 1e-6 of the whole gradient's norm counts as
    none: that is fp32 rounding at the whole gradient's scale (a parameter whose own gradient is tiny,
    or exactly zero, is judged there)."""
    floor = 1e-6 * torch.cat([g.flatten() for g in own.values()]).norm()
    worst = 0.0
    for name, ref in own.items():
        error = (ours.get(name, torch.zeros_like(ref)) - ref).norm()
        if error > floor:
            worst = max(worst, float(error / ref.norm()))
    return worst


def _build(model_type: str, variant: str):
    """The tiny config, the model's own eager reference and its log-probs and gradients, or a `not built` row.
    Multi-latent attention families need as many key/value heads as query heads: tried second."""
    from transformers import AutoModelForCausalLM

    error = None
    for overrides in ({}, {"num_key_value_heads": _SIZES["num_attention_heads"]}):
        try:
            config = tiny_config(model_type, variant, **overrides)
            if config is None:
                return None
            if config.get_text_config() is not config:
                return Row(model_type, variant, "not built", "multimodal: its text model is swept on its own")
            with torch.device("meta"):
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())
            if size > _MAX_PARAMETERS:
                return Row(model_type, variant, "not built", f"{size / 1e6:.0f}M parameters at the sizes this sweep sets")
            torch.manual_seed(0)
            # A copy: from_config records the attention implementation in the config it is given.
            reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                                         dtype=torch.float32)
            reference.eval()  # the model's own inference forward: what a sampler computes
            seqs = _sequences(random.Random(0))
            lp_ref, grads_ref = _own(reference, seqs)
            return config, reference, lp_ref, grads_ref, seqs
        except Exception as err:  # noqa: BLE001 -- a family that cannot be built or run this small is listed
            error = error or err
    return Row(model_type, variant, "not built", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}")


def _whole(ours: dict, own: dict) -> float:
    flat = lambda g: torch.cat([g.get(n, torch.zeros_like(r)).flatten() for n, r in own.items()])  # noqa: E731
    return float((flat(ours) - flat(own)).norm() / flat(own).norm())


def check_family(model_type: str, variant: str) -> Row:
    from transformers import AutoModelForCausalLM

    built = _build(model_type, variant)
    if built is None or isinstance(built, Row):
        return built
    config, reference, lp_ref, grads_ref, seqs = built
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ZORRO_ATTENTION,
                                                 dtype=torch.float32)
        model.load_state_dict(reference.state_dict())
        inference_behaviour(model)  # as the engine runs it
    except Exception as err:  # noqa: BLE001 -- as the engine does at load (arctic_rl_core/models/loading.py)
        return Row(model_type, variant, "refused", f"cannot be built with ZoRRo's attention ({type(err).__name__}: {err})")
    try:
        check_features(config)
        wrapper = ResponseLogits(model, model, output_head(config), BACKEND)
        check_exactness(wrapper, wrapper, model, zorro=True, pad_id=0, vocab_size=VOCAB, device=torch.device("cpu"),
                        dtype=torch.float32)
    except InvalidRequest as err:
        return Row(model_type, variant, "refused", err.message.split(": ", 1)[-1])
    try:
        lp, grads = _ours(model, seqs)
    except Exception as err:  # noqa: BLE001 -- accepted at load but failing at the first call: a finding
        return Row(model_type, variant, "error", f"{type(err).__name__}: {str(err).splitlines()[0][:90]}")
    lp_error, grad_error = float((lp - lp_ref).abs().max()), _grad_error(grads, grads_ref)
    direct = max(lp_error / LOGPROB_TOLERANCE, grad_error / GRAD_TOLERANCE)
    if direct <= _SURE:
        return Row(model_type, variant, "exact", "", lp_error, grad_error, _whole(grads, grads_ref), direct)
    # Some families are noisy in fp32 themselves (a gradient through a near-zero norm, a router's near-tie):
    # measure both against the model in fp64 and hold ours to twice the model's own fp32 error. Exact is
    # either bound met; near the direct one, both are measured, so the row's margin is the better of the two.
    reference.double()
    if hasattr(reference, "set_experts_implementation"):
        reference.set_experts_implementation("eager")  # grouped matmuls take no fp64
    lp64, grads64 = _own(reference, seqs)
    own = float((lp_ref - lp64).abs().max()), _grad_error(grads_ref, grads64)
    ours = float((lp - lp64).abs().max()), _grad_error(grads, grads64)
    versus_fp64 = max(ours[0] / (2 * own[0] + LOGPROB_TOLERANCE), ours[1] / (2 * own[1] + GRAD_TOLERANCE))
    detail = f"vs fp64: ours {ours[0]:.1e} / {ours[1]:.1e}, its own fp32 {own[0]:.1e} / {own[1]:.1e}"
    if min(direct, versus_fp64) <= 1:
        return Row(model_type, variant, "exact", detail, lp_error, grad_error, _whole(grads, grads_ref),
                   min(direct, versus_fp64), judged_by_fp64=direct > 1)
    return Row(model_type, variant, "wrong", detail, lp_error, grad_error)


def sweep() -> list[Row]:
    rows = []
    for model_type in decoder_families():
        for variant in ("default", *_FEATURES):
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                row = check_family(model_type, variant)
            if row is not None:
                rows.append(row)
    return rows


_NUMBER = re.compile(r"\d+\.\d+(?:e[-+]?\d+)?")


def render(rows: list[Row]) -> str:
    """docs/models.md: the table, which holds only what does not vary by machine (outcomes and reasons: an exact
    row is exact whichever of its two bounds held), then the errors measured on the machine that wrote it."""
    count = {o: sum(r.outcome == o for r in rows) for o in ("exact", "refused", "not built", "wrong", "error")}
    exact = [r for r in rows if r.outcome == "exact"]
    lines = [
        "# Model families",
        "",
        "Every decoder-only causal-LM family of the installed transformers, at tiny random size, with its",
        "defaults and with each optional feature its config has turned on (`window 3`: a sliding window of 3",
        "tokens on the layers that slide; `attention softcap`, `final softcap`, `logit scale`). Each is",
        "either **exact** — ZoRRo's packed forest through the engine's path (split attention on its tiled `math`",
        "primitives; the faster kernels have their own parity tests) against the model's own eager",
        "forward of each sequence alone, log-probs within 2e-6 and every parameter's gradient within 1e-5",
        "relative in fp32, or, where that is not met, within twice the model's own fp32 error against fp64",
        "(families noisy in fp32 themselves) — or **refused** at load by the engine's checks",
        "(`arctic_rl_core/models/exactness.py`), with the reason below; the model then trains with",
        "`zorro.enable=false` and its own attention. **Not built**: the family cannot be built this small",
        "(or needs inputs other than text); it is not claimed either way.",
        "",
        f"transformers {_transformers_version()}: {count['exact']} exact, {count['refused']} refused, "
        f"{count['not built']} not built, {count['wrong'] + count['error']} wrong.",
        "",
        "Regenerate with `python -m tests.model_sweep > docs/models.md`; `make test` checks the table is current.",
        "",
        "| family | variant | outcome | reason |",
        "|---|---|---|---|",
    ]
    for r in rows:
        reason = "" if r.outcome == "exact" else _NUMBER.sub("…", r.detail).replace("|", "\\|")
        lines.append(f"| {r.model_type} | {r.variant} | {r.outcome} | {reason} |")
    closest = max(exact, key=lambda r: r.bound_used, default=None)
    lines += [
        "",
        "Measured on the machine that wrote this file (not compared: the last bits differ between CPUs). Largest",
        f"errors of the exact rows: log-prob {max((r.logprob_error for r in exact), default=0):.1e}; whole gradient "
        f"{max((r.whole_grad_error for r in exact), default=0):.1e} relative; worst single parameter "
        f"{max((r.grad_error for r in exact), default=0):.1e} relative (errors under 1e-6 of the whole",
        "gradient's norm, fp32 rounding at its scale, not counted)."
        + (f" The closest to its bound: {closest.model_type} {closest.variant}, {closest.bound_used:.0%} of it." if closest else ""),
        "Past the direct tolerance, within the model's own fp32 error against fp64: "
        + (", ".join(f"{r.model_type} {r.variant} ({r.detail})" for r in exact if r.judged_by_fp64) or "none") + ".",
    ]
    return "\n".join(lines) + "\n"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # as pytest puts it, for replay_sweep's imports
    from replay_sweep import render_replay, replay_sweep

    print(render(sweep()) + render_replay(replay_sweep()), end="")
