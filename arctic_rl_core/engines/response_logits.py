"""The module a training engine wraps: a causal LM returning logits only where responses are predicted,
or, without the full logits tensor, their log-probs (and entropy) computed in chunks."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import Registered
from arctic_rl_core.models.head import OutputHead
from arctic_rl_kernels.layout import ForestLayout


class ResponseLogits(torch.nn.Module):
    """Prompt positions never reach the LM head, which matters at real vocabulary sizes. The head is
    the family's own (`OutputHead`: its scaling and softcap), so these are the model's logits.

    Given `zorro_layout`, the batch is one packed prefix forest and attention is
    ZoRRo's split attention (the model must be loaded with that attention
    implementation); otherwise a right-padded batch.
    """

    chunk_elements = 2**26
    """Logits computed at once by the chunked path: 256 MB in fp32 (about 440 rows of a 152k vocabulary)."""

    def __init__(self, model: torch.nn.Module, causal_lm: torch.nn.Module, head: OutputHead, zorro_backend: str = "auto"):
        super().__init__()
        self.model = model
        self._causal_lm = [causal_lm]  # a list: not a second registration of the same parameters
        self.head = head
        self.zorro_backend = zorro_backend
        self.last_delivery = None
        """The attention calls of the last packed forward (`Delivery`: checked at load)."""
        self.router_replay = None
        """A mixture-of-experts model's `RouterReplay`, where the job replays routing (installed by the engine)."""

    def forward(self, input_ids: torch.Tensor, logit_rows: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, zorro_layout: ForestLayout | None = None,
                targets: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                routes: torch.Tensor | None = None, routes_known: torch.Tensor | None = None, record_routes: bool = False):
        """Logits [rows, vocab]; or, given `targets`, {"logprobs", "entropy"?} at `temperature`, chunk by chunk.
        `routes` where `routes_known` are replayed; `record_routes` keeps the routing taken in `router_replay`."""
        lm = self._causal_lm[0]
        replaying(self.router_replay, routes, routes_known, record_routes)
        rows, self.last_delivery = response_hidden(lm, input_ids, logit_rows, attention_mask, position_ids,
                                                   zorro_layout, self.zorro_backend, self.last_delivery)
        if targets is None:
            return self.head(lm.get_output_embeddings(), rows)
        return self._chunked(lm.get_output_embeddings(), rows, targets, temperature, with_entropy)

    def _chunked(self, lm_head, rows, targets, temperature, with_entropy) -> dict[str, torch.Tensor]:
        """The built-in post-processors' arithmetic (apply_temperature, compute_logprobs, compute_entropy) on one
        chunk of rows at a time; each chunk's logits are recomputed in backward instead of kept."""

        def piece(hidden, target):
            logits = self.head(lm_head, hidden)
            if temperature != 1.0:
                logits = logits / temperature
            logits = logits.float()
            out = [logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)]
            if with_entropy:
                logp = torch.log_softmax(logits, dim=-1)
                out.append(-(logp.exp() * logp).sum(-1))
            return tuple(out)

        vocab = lm_head.weight.shape[0]
        step = max(1, self.chunk_elements // vocab)
        pieces = [checkpoint(piece, rows[i : i + step], targets[i : i + step], use_reentrant=False)
                  for i in range(0, rows.shape[0], step)]
        out = {"logprobs": torch.cat([p[0] for p in pieces])}
        if with_entropy:
            out["entropy"] = torch.cat([p[1] for p in pieces])
        return out


class ResponseValues(torch.nn.Module):
    """A critic: the causal LM's decoder and a linear value head (hidden -> 1) read at the same rows as the
    log-probs, so a response token's value is that of the state before it (verl's and OpenRLHF's layout).
    The head starts at zero: every value is 0 until the critic trains. Packed (ZoRRo) or padded, as the
    policy's module."""

    def __init__(self, causal_lm: torch.nn.Module, zorro_backend: str = "auto"):
        super().__init__()
        self.model = causal_lm
        lm_head = causal_lm.get_output_embeddings()
        if lm_head.weight is not causal_lm.get_input_embeddings().weight:
            lm_head.requires_grad_(False)  # unused by a critic (tied, it is the input embedding, which trains)
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1, dtype=lm_head.weight.dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.zorro_backend = zorro_backend
        self.last_delivery = None
        self.router_replay = None

    def forward(self, input_ids: torch.Tensor, logit_rows: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, zorro_layout: ForestLayout | None = None,
                routes: torch.Tensor | None = None, routes_known: torch.Tensor | None = None) -> torch.Tensor:
        """One value per row of `logit_rows`, in fp32; `routes` replayed as `ResponseLogits`'."""
        replaying(self.router_replay, routes, routes_known, False)
        rows, self.last_delivery = response_hidden(self.model, input_ids, logit_rows, attention_mask, position_ids,
                                                   zorro_layout, self.zorro_backend, self.last_delivery)
        return self.value_head(rows).squeeze(-1).float()


def replaying(replay, routes: torch.Tensor | None, known: torch.Tensor | None, record: bool) -> None:
    """Sets what the next forward replays (and records); the state stays until the next call, for the recomputed
    forward of gradient checkpointing in backward."""
    if replay is not None:
        replay.use(routes, known, record=record)
    elif routes is not None:
        raise RuntimeError("routes given to a model without router replay")


def response_hidden(lm, input_ids, logit_rows, attention_mask, position_ids, zorro_layout, zorro_backend, delivery):
    """The decoder's last hidden states at `logit_rows` (ZoRRo's packed forest given `zorro_layout`, else a
    right-padded batch), and the attention calls of a packed forward (`Delivery`; `delivery` otherwise)."""
    decoder = _decoder(lm)
    if zorro_layout is not None:
        from arctic_rl_core.zorro.attention import expect_layout

        with expect_layout(zorro_layout) as delivery:
            hidden = decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False,
                zorro_layout=zorro_layout, zorro_backend=zorro_backend,
            ).last_hidden_state
    else:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, logit_rows), delivery


def _decoder(lm: torch.nn.Module) -> torch.nn.Module:
    """The causal LM's decoder (its final hidden states), also where `base_model_prefix` names no attribute."""
    base = lm.base_model
    return lm.model if base is lm and isinstance(getattr(lm, "model", None), torch.nn.Module) else base


def inputs_on_device(inputs: LossInputs, device: torch.device) -> LossInputs:
    return LossInputs(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(inputs).items()})


def folded_temperature(post: list[tuple[Registered, Any]]) -> float | None:
    """The product of the temperatures when `post` holds only the built-in `apply_temperature`, else None
    (another post-processor may need the logits themselves)."""
    from arctic_rl_core.losses.post_processors import apply_temperature

    temperature = 1.0
    for processor, cfg in post:
        if processor.fn is not apply_temperature:
            return None
        temperature *= cfg.temperature
    return temperature


def model_inputs(mb: MicroBatch, device: torch.device) -> dict[str, Any]:
    """A micro-batch's forward arguments for a `ResponseLogits` or `ResponseValues`, on `device`."""
    def to_device(t):
        return t.to(device) if t is not None else None

    routes = {} if mb.routes is None else dict(routes=mb.routes.to(device), routes_known=mb.routes_known.to(device))
    return dict(input_ids=mb.input_ids.to(device), logit_rows=mb.logit_rows.to(device),
                attention_mask=to_device(mb.attention_mask), position_ids=to_device(mb.position_ids),
                zorro_layout=mb.layout, **routes)


def response_outputs(forward: Callable[..., Any], mb: MicroBatch, post: list[tuple[Registered, Any]], with_entropy: bool,
                     device: torch.device, record_routes: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch through `forward` (a `ResponseLogits`, or an engine wrapping one): the response tokens'
    "targets", "logprobs" and, with `with_entropy`, "entropy", after the post-processors `post`. `record_routes`:
    a router-replaying model keeps the routing this forward takes."""
    from arctic_rl_core.losses.post_processors import compute_entropy, compute_logprobs

    batch = model_inputs(mb, device)
    if record_routes:
        batch["record_routes"] = True
    targets = mb.targets.to(device)
    temperature = folded_temperature(post)
    if temperature is not None:
        # Only built-in post-processors: log-probs in chunks, never the full [rows, vocab] logits.
        chunked = forward(**batch, targets=targets, temperature=temperature, with_entropy=with_entropy)
        return {"targets": targets, **chunked}
    outputs = {"logits": forward(**batch), "targets": targets}
    chain = [(entry.fn, cfg) for entry, cfg in post] + [(compute_logprobs, None)]
    if with_entropy:
        chain.append((compute_entropy, None))
    for fn, cfg in chain:
        outputs.update(fn(outputs, mb.inputs, cfg))
    return outputs
