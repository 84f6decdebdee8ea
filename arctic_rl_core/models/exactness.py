"""Load-time checks that the engine's log-probs are the model's own, or a refusal naming why.

Checks on a tiny probe batch (a shared prefix with two continuations, and an unrelated sequence),
each a clear `InvalidRequest` at load instead of wrong numbers at the first call:

- **features**: model types and settings split attention cannot honour, refused by name
  (`zorro_refusals`, before any weight is read);
- **the model's own forward**: the engine's path on a padded batch (its attention and its head,
  `OutputHead`) against the model's own `forward(...).logits` with its eager attention;
- **packing** (ZoRRo): every attention call must receive the layout; the packed forest's
  log-probs must equal one sequence per row; and a packed sequence's log-probs must not change
  when the sequences packed before it do. This catches decoder layers that drop the layout,
  attention that bypasses transformers' attention interface or is not causal, a sliding window
  applied only through transformers' mask, and layers other than attention (recurrent or
  convolutional mixers) that would mix the packed sequences, in half precision as in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from arctic_rl_core.errors import InvalidRequest

# Probe log-prob differences allowed: rounding, not a different computation. A dropped layout or
# a mixed pack moves random tiny models by nats and real ones by far more than half-precision noise.
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_HALF_TOLERANCE = 5e-2
_MIXING_TOLERANCE = 1e-5

_DISABLE = "set zorro.enable=false to train it with its own attention"


def _kernel_failure(err: Exception) -> InvalidRequest | None:
    """A Triton kernel that fails on this device (compiling it, launching it) is the backend's failure, not the
    family's: named as `zorro.attention_backend`, with the tiled primitives as the way out."""
    if not type(err).__module__.startswith("triton"):
        return None
    return InvalidRequest("zorro.attention_backend", f"the triton kernel fails on this device ({type(err).__name__}: "
                                                     f"{err}); choose zorro.attention_backend=math")


def zorro_refusals(config) -> list[str]:
    """Settings of `config` that split attention cannot compute, by name."""
    text = config.get_text_config()
    found = []
    if getattr(text, "attention_chunk_size", None):
        found.append(f"chunked attention (attention_chunk_size={text.attention_chunk_size})")
    if getattr(text, "use_bidirectional_attention", False):
        found.append("bidirectional attention (use_bidirectional_attention)")
    if getattr(config, "is_encoder_decoder", False):
        found.append("an encoder-decoder architecture")
    return found


def zorro_attention_possible(config) -> bool:
    """Whether ZoRRo's attention may be loaded for `config` without being asked for: no feature refused by
    name, and a model class that can switch back to its own attention if the load probe refuses it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if zorro_refusals(config):
        return False
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return False
    return model_class._can_set_attn_implementation()


def check_features(config) -> None:
    found = zorro_refusals(config)
    if found:
        raise InvalidRequest("zorro.enable", f"{config.model_type}: ZoRRo's split attention does not support "
                                             f"{', '.join(found)}; {_DISABLE}")


def _configured_window(config) -> int | None:
    """The sliding window some layer of `config` uses, if any."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None and not any("sliding" in str(t) for t in types):
        return None
    return window


def _probe_sequences(vocab_size: int, seed: int = 0, last=None):
    """Two sequences sharing a prefix of 6 tokens, then `last` (default: a random one). The first two
    start with token 0 and part at tokens 1 and 2, the last starts with the highest id: every seed
    packs into the same forest shape, with the last sequence after the others."""
    from arctic_rl_core.types import Sequence

    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prefix = [0] + ids(5)
    full = [prefix + [1] + ids(4), prefix + [2] + ids(2), last or [vocab_size - 1] + ids(3)]
    return [Sequence(prompt_ids=f[:1], response_ids=f[1:]) for f in full]


@contextmanager
def _eager_attention(causal_lm):
    """The model's own reference: its eager attention (transformers' SDPA drops Gemma 2's softcap), set for
    the duration where the family allows switching, else the attention it was loaded with."""
    loaded = causal_lm.config._attn_implementation
    switch = loaded != "eager" and causal_lm._can_set_attn_implementation()
    if switch:
        causal_lm.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            causal_lm.set_attn_implementation(loaded)


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


@torch.no_grad()
def check_exactness(forward, wrapper, causal_lm, *, zorro: bool, pad_id: int, vocab_size: int, device, dtype) -> None:
    """`forward` runs the engine's wrapped `ResponseLogits` (`wrapper`); `causal_lm` is the model itself."""
    from arctic_rl_core.batching import build_micro_batches
    from arctic_rl_core.zorro.attention import LayoutNotDelivered

    model_type = causal_lm.config.model_type
    tolerance = _TOLERANCE.get(dtype, _HALF_TOLERANCE)
    seqs = _probe_sequences(vocab_size)

    def run(mb, seqs=seqs):
        logits = forward(
            input_ids=mb.input_ids.to(device), logit_rows=mb.logit_rows.to(device),
            attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(device),
            position_ids=None if mb.position_ids is None else mb.position_ids.to(device), zorro_layout=mb.layout,
        )
        logprobs = _logprobs(logits, mb.targets.to(device))
        # A forest packs sequences in its own order: back to the probe's order.
        parts = dict(zip(mb.sequence_ids, torch.split(logprobs, mb.response_lengths)))
        return torch.cat([parts[i] for i in range(len(seqs))])

    [padded] = build_micro_batches(seqs, token_budget=10**9, weight_version=0, pad_id=pad_id)
    try:
        with _eager_attention(causal_lm):
            logits = causal_lm(input_ids=padded.input_ids.to(device), attention_mask=padded.attention_mask.to(device),
                               use_cache=False).logits
        rows = logits.reshape(-1, logits.shape[-1]).index_select(0, padded.logit_rows.to(device))
        own = _logprobs(rows, padded.targets.to(device))  # a padded batch keeps the probe's order
        ours = run(padded)
    except Exception as err:  # noqa: BLE001 -- whatever fails here is a family the engine cannot run as loaded
        if (failure := _kernel_failure(err)) is not None:
            raise failure from None
        if zorro:  # e.g. a family whose layers need the dense mask transformers builds for its own attention
            raise InvalidRequest("zorro.enable", f"{model_type}: a forward with ZoRRo's attention fails "
                                                 f"({type(err).__name__}: {err}); {_DISABLE}") from None
        raise InvalidRequest("model_path", f"{model_type}: Arctic RL cannot compute this family's logits "
                                           f"({type(err).__name__}: {err})") from None
    head_error = float((ours - own).abs().max())
    if not head_error <= tolerance:
        field, what = ("zorro.enable", "ZoRRo's attention or its") if zorro else ("model_path", "its")
        raise InvalidRequest(field, f"{model_type}: Arctic RL does not reproduce {what} output head (log-probs differ "
                                    f"from the model's own eager forward by {head_error:.3g})"
                                    + (f"; {_DISABLE}" if zorro else ""))
    if not zorro:
        return
    [packed] = build_micro_batches(seqs, token_budget=10**9, weight_version=0, pad_id=pad_id, forest=True)
    try:
        shared = run(packed)
    except LayoutNotDelivered as err:
        raise InvalidRequest("zorro.enable", f"{model_type}: {err}, so its attention would run over the whole "
                                             f"pack; {_DISABLE}") from None
    except Exception as err:  # noqa: BLE001 -- as above, for the packed forest
        if (failure := _kernel_failure(err)) is not None:
            raise failure from None
        raise InvalidRequest("zorro.enable", f"{model_type}: a packed forward fails ({type(err).__name__}: {err}); "
                                             f"{_DISABLE}") from None
    delivery = wrapper.last_delivery
    if delivery is None or delivery.calls == 0:
        raise InvalidRequest("zorro.enable", f"{model_type}: no attention of it received the layout (none of its "
                                             f"layers uses transformers' attention interface); {_DISABLE}")
    window = _configured_window(causal_lm.config)
    if window is not None and not delivery.windows:
        raise InvalidRequest("zorro.enable", f"{model_type}: its sliding window ({window}) is applied only through "
                                             f"the mask transformers builds for its own attention, which split "
                                             f"attention does not receive; {_DISABLE}")
    pack_error = float((shared - ours).abs().max())
    if not pack_error <= tolerance:
        raise InvalidRequest("zorro.enable", f"{model_type}: packing sequences changes its log-probs by "
                                             f"{pack_error:.3g}; {_DISABLE}")
    # Mixing, in any precision: the last sequence's log-probs must not depend on the tokens packed before
    # it. Same shapes, so without mixing they are equal up to kernel nondeterminism, far below rounding.
    last = seqs[-1].prompt_ids + seqs[-1].response_ids
    others = _probe_sequences(vocab_size, seed=1, last=last)
    [repacked] = build_micro_batches(others, token_budget=10**9, weight_version=0, pad_id=pad_id, forest=True)
    n = len(seqs[-1].response_ids)
    mixing = float((run(repacked, others)[-n:] - shared[-n:]).abs().max())
    if not mixing <= _MIXING_TOLERANCE:
        raise InvalidRequest("zorro.enable", f"{model_type}: a packed sequence's log-probs change by {mixing:.3g} "
                                             f"with the tokens packed before it (a layer other than attention, e.g. "
                                             f"a recurrent or convolutional one, mixes the pack); {_DISABLE}")
    check_attention_backward(delivery.shapes, wrapper.zorro_backend, device, dtype)


_BACKWARD_PROBE_LENGTHS = (2048, 32768)
"""Lengths at which `auto` may pick another backend (it picks by the measured length nearest a forest's)."""


_BACKWARD_PARITY = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""How far (relative norm) a backend's attention output and gradients may be from the math primitives' at load:
fp32 kernels summing in another order, 16-bit ones rounding P and dS before their products."""


def _probe_layout(device):
    """A forest whose segments span several of the kernels' tiles (16 under the interpreter, up to 128 on a GPU),
    so the masked and unmasked tile paths both run."""
    from arctic_rl_kernels.layout import ForestLayout

    if torch.device(device).type == "cuda":
        return ForestLayout.groups([320], [[192, 160]])
    return ForestLayout.groups([40], [[24, 24]])


@torch.enable_grad()
def check_attention_backward(shapes, backend: str, device, dtype) -> None:
    """Split attention's forward and backward at each attention shape the packed probe's forward called it with
    (heads, KV heads, head sizes, softcap, window, sinks: `Delivery.shapes`), for every backend `backend` runs at
    some length, against the math primitives: a kernel that cannot run here (too much shared memory or registers
    for its tiles), or that a compiler got wrong for this device, is refused at load, not met at the first fwd_bwd.
    Tiles depend on dtype and head size, not on length, so a small forest launches the same kernels."""
    from arctic_rl_kernels.split_attention import ScoreMods, select_ops, split_attention

    layout = _probe_layout(device)
    gen = torch.Generator(device).manual_seed(0)
    for shape in sorted(shapes, key=str):
        heads, kv_heads, head_dim, value_dim, softcap, window, sinks = shape
        mods = ScoreMods(softcap=softcap, window=window)
        names = {select_ops(backend, device, dtype, mods, head_dim == value_dim, head_dim, n).name
                 for n in _BACKWARD_PROBE_LENGTHS}
        q = torch.randn(heads, layout.num_tokens, head_dim, generator=gen, device=device).to(dtype).requires_grad_()
        k = torch.randn(kv_heads, layout.num_tokens, head_dim, generator=gen, device=device).to(dtype).requires_grad_()
        v = torch.randn(kv_heads, layout.num_tokens, value_dim, generator=gen, device=device).to(dtype).requires_grad_()
        s_aux = torch.zeros(heads, device=device, dtype=dtype, requires_grad=True) if sinks else None
        inputs = [t for t in (q, k, v, s_aux) if t is not None]
        dout = torch.randn(heads, layout.num_tokens, value_dim, generator=gen, device=device).to(dtype)

        def run(name):
            out = split_attention(q, k, v, layout, head_dim**-0.5, name, softcap=softcap, window=window, sinks=s_aux)
            return [t.detach().float() for t in (out, *torch.autograd.grad(out, inputs, dout))]

        reference = run("math") if names - {"math"} else None
        for name in sorted(names):
            try:
                got = run(name)
            except Exception as err:  # noqa: BLE001 -- a kernel that cannot run here
                raise _kernel_failure(err) or InvalidRequest(
                    "zorro.attention_backend", f"the {name} split-attention backward fails on this device "
                                               f"({type(err).__name__}: {err}); choose zorro.attention_backend=math"
                ) from None
            if reference is None or name == "math":
                continue
            error = max(float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, reference))
            if not error <= _BACKWARD_PARITY.get(dtype, 2e-2):
                raise InvalidRequest(
                    "zorro.attention_backend", f"the {name} split attention differs from the math primitives by "
                                               f"{error:.3g} (relative) on this device at heads={heads}, "
                                               f"kv_heads={kv_heads}, head size {head_dim}/{value_dim}, "
                                               f"softcap={softcap}, window={window}; choose "
                                               f"zorro.attention_backend=math")
