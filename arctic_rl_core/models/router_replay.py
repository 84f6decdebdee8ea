"""Router replay: the experts each token was routed to, recorded in one forward and forced in later ones.

In a mixture-of-experts layer a router scores every expert and keeps the top k. The sampler and the trainer compute
those scores separately, and rounding flips close choices, layer after layer: the trainer's log-prob of a sampled
token then runs through experts that never sampled it. Replay (R3: the sampler's choices; R2: the trainer's own
old-policy pass) forces only the *choice*. The layer's own rule still weighs the chosen experts from the live scores
(softmax or sigmoid, renormalisation, scaling), so the router keeps its gradient.

How, for any family: every mixture-of-experts family in transformers chooses its experts with one `torch.topk` over a
[tokens, experts] score matrix inside its router. While that router runs, a `TorchFunctionMode` answers that one
call with the recorded indices and the scores gathered at them; everything the family does with them is its own
code. Where that is not so (no such top-k, or several), `RouterReplay.probe` finds it at load and the job is refused
by the family's name.

A routing record is `[tokens, num_hidden_layers, top_k]` expert ids: one row per token, the layer axis the absolute
decoder index (vLLM's `routed_experts` layout), rows of dense layers ignored. Tokens without a record (vLLM sends none
for the final sampled token, whose output no log-prob reads) route natively.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from arctic_rl_core.errors import InvalidRequest

_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k", "moe_k")
_EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "num_routed_experts")
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)$")


def moe_shape(hf_config) -> tuple[int, int] | None:
    """(experts, top_k) from a Hugging Face config; None for a dense model (no config key names several experts)."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts = next((getattr(config, k) for k in _EXPERT_COUNT_KEYS if isinstance(getattr(config, k, None), int)), None)
    top_k = next((getattr(config, k) for k in _TOP_K_KEYS if isinstance(getattr(config, k, None), int)), None)
    if not experts or experts < 2 or not top_k:
        return None
    return experts, top_k


@dataclass(frozen=True)
class ReplayShape:
    """What a routing record must fit: plain data, so a trainer group's driver checks records its ranks replay."""

    family: str
    num_layers: int
    top_k: int
    experts: int
    moe_layers: tuple[int, ...]


@dataclass
class MoeLayer:
    index: int
    """Absolute decoder index: the record's layer axis."""
    name: str
    block: torch.nn.Module
    """The module holding the layer's experts."""
    router: torch.nn.Module
    """Where the top-k choice runs: the block's `gate` or `router` child, or the block itself where the child is a
    bare projection (the probe finds which)."""


class _Routing:
    """What the next forwards replay and record. It lives until replaced, not for one forward: gradient
    checkpointing runs a layer's forward again in backward, which must route as the forward did."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.routes: torch.Tensor | None = None  # [tokens, layers, top_k] long
        self.known: torch.Tensor | None = None  # [tokens] bool: rows that replay
        self.recording = False
        self.record: torch.Tensor | None = None  # [tokens, layers, top_k] long, filled by the next forward
        self.calls: dict[int, int] = {}


class _TopKSwap(TorchFunctionMode):
    """Active only inside one layer's router: its expert top-k answered from the record, and noted."""

    def __init__(self, layer: int, experts: int, top_k: int, routing: _Routing):
        super().__init__()
        self.layer, self.experts, self.top_k, self.routing = layer, experts, top_k, routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.topk and func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        scores, k = args[0], (args[1] if len(args) > 1 else kwargs.get("k"))
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if not (scores.dim() == 2 and scores.shape[1] == self.experts and k == self.top_k and dim in (-1, 1) and largest):
            return func(*args, **kwargs)  # another top-k (a group choice, a sparse attention's indexer)
        routing = self.routing
        routing.calls[self.layer] = routing.calls.get(self.layer, 0) + 1
        values, indices = func(*args, **kwargs)
        if routing.routes is not None:
            if routing.routes.shape[0] != scores.shape[0]:
                raise RuntimeError(f"router replay: layer {self.layer} routes {scores.shape[0]} tokens, the record has "
                                   f"{routing.routes.shape[0]}")
            indices = torch.where(routing.known[:, None], routing.routes[:, self.layer], indices)
            values = scores.gather(1, indices)
        if routing.recording:
            if routing.record is None:
                routing.record = torch.zeros(scores.shape[0], routing.num_layers, self.top_k, dtype=torch.long,
                                             device=indices.device)
            routing.record[:, self.layer] = indices.detach()
        return torch.return_types.topk((values, indices))


class RouterReplay:
    """Replay and recording for one loaded model: hooks on each MoE layer's router, idle until `use`. Build it with
    `for_model`, which probes the family and refuses it where its routing cannot be replayed."""

    def __init__(self, model: torch.nn.Module, hf_config):
        shape = moe_shape(hf_config)
        if shape is None:
            raise ValueError("a dense model has no router to replay")
        self.experts, self.top_k = shape
        config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.num_layers = config.num_hidden_layers
        self.family = config.model_type
        self.routing = _Routing(self.num_layers)
        self.decoder_layers = {int(m.group(1)): module for name, module in model.named_modules()
                               if (m := _LAYER_NAME.search(name)) is not None}
        self.layers = _moe_layers(model, self.family)
        self._hooks: list = []

    @classmethod
    def for_model(cls, model: torch.nn.Module, hf_config, forward) -> "RouterReplay | None":
        """Installed replay for `model`, or None for a dense model (it has nothing to replay). `forward()` runs the
        model on a few tokens and returns its output: the probe's."""
        if moe_shape(hf_config) is None:
            return None
        replay = cls(model, hf_config)
        replay.probe(forward)
        return replay

    @property
    def shape(self) -> ReplayShape:
        return ReplayShape(self.family, self.num_layers, self.top_k, self.experts, tuple(l.index for l in self.layers))

    # -- the record's use -------------------------------------------------------------------------

    def use(self, routes: torch.Tensor | None = None, known: torch.Tensor | None = None, record: bool = False) -> None:
        """The next forwards (until the next `use`) replay `routes` ([tokens, layers, top_k], the forward's flattened
        token order, on the model's device) where `known` (default: every row), and with `record` keep the routing
        they take in `recorded`. `use()` turns both off."""
        r = self.routing
        r.routes = None if routes is None else routes.long()
        r.known = None if routes is None else (
            torch.ones(routes.shape[0], dtype=torch.bool, device=routes.device) if known is None else known)
        r.recording, r.record, r.calls = record, None, {}

    @property
    def recorded(self) -> torch.Tensor | None:
        """[tokens, layers, top_k]: the routing the forwards since `use(record=True)` took (dense layers' rows 0)."""
        return self.routing.record

    @property
    def active(self) -> bool:
        return self.routing.routes is not None or self.routing.recording

    # -- hooks ----------------------------------------------------------------------------------------

    def install(self, scopes: dict[int, torch.nn.Module] | None = None) -> None:
        """A top-k swap around each scope's forward (default: each MoE layer's router), entered only while active."""
        if self._hooks:
            raise RuntimeError("router replay is already installed on this model")
        scopes = {layer.index: layer.router for layer in self.layers} if scopes is None else scopes
        for index, scope in scopes.items():
            swap = _TopKSwap(index, self.experts, self.top_k, self.routing)

            def enter(module, args, swap=swap):
                if self.active:
                    swap.__enter__()
                    module._arctic_rl_topk_swap = swap

            def leave(module, args, output):
                entered = module.__dict__.pop("_arctic_rl_topk_swap", None)
                if entered is not None:
                    entered.__exit__(None, None, None)

            self._hooks += [scope.register_forward_pre_hook(enter), scope.register_forward_hook(leave, always_call=True)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the load-time probe ----------------------------------------------------------------------------

    def probe(self, forward) -> None:
        """Install, or refuse (`InvalidRequest` on `router_replay`, naming the family) a model whose routing cannot
        be replayed. Checked: MoE layers were found; each decoder layer makes exactly one expert choice (a top-k over
        [tokens, experts]) if it has experts and none if not; replaying the recorded choice gives the same output bit
        for bit; replaying another choice changes it (the layers route by the indices they are given)."""
        family = self.family
        if not self.layers:
            raise InvalidRequest("router_replay", f"{family}: its config names {self.experts} experts, but no decoder "
                                 "layer has an `experts` module to find its router by; its routing cannot be replayed")
        moe = {layer.index for layer in self.layers}
        counts = self._choices(self.decoder_layers, forward)
        wrong = {i: counts.get(i, 0) for i in sorted(self.decoder_layers) if counts.get(i, 0) != (1 if i in moe else 0)}
        if wrong:
            raise InvalidRequest("router_replay", f"{family}: its router does not choose its {self.top_k} of "
                                 f"{self.experts} experts with one torch.topk over [tokens, experts] per MoE layer "
                                 f"(such top-k calls in its decoder layers {wrong}, MoE layers {sorted(moe)}); "
                                 "its routing cannot be replayed")
        for layer in self.layers:  # a router child that is a bare projection: the block makes the choice
            if self._choices({layer.index: layer.router}, forward).get(layer.index, 0) != 1:
                layer.router = layer.block
        self.install()
        try:
            self.use(record=True)
            native = forward()
            recorded = self.recorded
            self.use(recorded)
            if not torch.equal(forward(), native):
                raise InvalidRequest("router_replay", f"{family}: replaying its own routing changes its output; "
                                     "its routing cannot be replayed exactly")
            moved = recorded.clone()
            index = sorted(moe)
            moved[:, index] = (moved[:, index] + 1) % self.experts
            self.use(moved)
            if torch.equal(forward(), native):
                raise InvalidRequest("router_replay", f"{family}: replaying other experts leaves its output unchanged; "
                                     "its layers do not route by the chosen indices")
        except BaseException:
            self.remove()
            raise
        finally:
            self.use()

    def _choices(self, scopes: dict[int, torch.nn.Module], forward) -> dict[int, int]:
        """How many expert choices each scope makes in one forward."""
        self.install(scopes)
        try:
            self.use(record=True)
            forward()
            return dict(self.routing.calls)
        finally:
            self.use()
            self.remove()


def _moe_layers(model: torch.nn.Module, family: str) -> list[MoeLayer]:
    """Each decoder layer's MoE block: the module holding an `experts` child."""
    layers = []
    for name, module in model.named_modules():
        match = _LAYER_NAME.search(name)
        if match is None:
            continue
        blocks = [(n, m) for n, m in module.named_modules() if "experts" in dict(m.named_children())]
        if not blocks:
            continue  # a dense layer
        if len(blocks) > 1:
            raise InvalidRequest("router_replay", f"{family}: layer {name} has {len(blocks)} expert blocks "
                                 f"({', '.join(n for n, _ in blocks)}); a record holds one routing per decoder layer")
        block_name, block = blocks[0]
        children = dict(block.named_children())
        router = next((children[c] for c in ("gate", "router") if c in children), block)
        layers.append(MoeLayer(int(match.group(1)), f"{name}.{block_name}".rstrip("."), block, router))
    return layers


def check_record(routes: np.ndarray, replay: ReplayShape, field: str) -> None:
    """Raise `InvalidRequest` on `field` unless `routes` ([tokens, layers, top_k]) fits this model: its layer count
    and top-k, and on each MoE layer distinct expert ids within range (a dense layer's rows are not read)."""
    _, layers, top_k = routes.shape
    if layers != replay.num_layers:
        raise InvalidRequest(f"{field}.layers", f"is {layers}; the model has {replay.num_layers} decoder layers")
    if top_k != replay.top_k:
        raise InvalidRequest(f"{field}.top_k", f"is {top_k}; the model routes each token to {replay.top_k} experts")
    moe = routes[:, list(replay.moe_layers)]
    if moe.size and (moe.min() < 0 or moe.max() >= replay.experts):
        bad = np.argwhere((moe < 0) | (moe >= replay.experts))[0]
        raise InvalidRequest(f"{field}.ids", f"token {bad[0]}, layer {replay.moe_layers[bad[1]]}: expert "
                             f"{moe[tuple(bad)]} is outside the model's {replay.experts} experts")
    ordered = np.sort(moe, axis=-1)
    repeated = np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(-1))
    if repeated.size:
        token, layer = repeated[0]
        raise InvalidRequest(f"{field}.ids", f"token {token}, layer {replay.moe_layers[layer]}: names an expert "
                             f"twice ({moe[token, layer].tolist()}); a token's {replay.top_k} experts are distinct")


def load_router_replay(causal_lm: torch.nn.Module, hf_config, device: torch.device) -> RouterReplay | None:
    """`RouterReplay` for a loaded causal LM, probed on a few tokens (refused by the family's name where its routing
    cannot be replayed), or None for a dense model."""
    ids = (torch.arange(3, 11, device=device) % hf_config.get_text_config().vocab_size)[None]

    @torch.no_grad()
    def forward() -> torch.Tensor:
        return causal_lm(input_ids=ids, use_cache=False).logits.float()

    return RouterReplay.for_model(causal_lm, hf_config, forward)
