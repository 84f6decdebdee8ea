"""`bench zorro`'s memory plan: gradient checkpointing and a micro-batch token budget chosen from an estimate of
the activations fwd_bwd keeps, so the bench's defaults run on the GPU at hand (an 80 GB H100 ran out of memory
at P=4096 with neither), or a clear error naming the flag.

The estimate counts what a decoder layer keeps for backward per token, in the model's dtype (with flash
attention no score matrix is kept): 8 x hidden for the residual stream and the norms (transformers' RMSNorm keeps
fp32 copies), 4 x (q + kv) dims for the projections, per-head norms, rotary outputs and attention output, and
6 x intermediate for the MLP's gate, up, activation and product. With checkpointing a layer keeps only its input,
and one layer's activations live at a time during the recompute. The output head adds nothing measurable (the
response rows' log-probs are taken in chunks). Measured on an H100 at Qwen3-0.6B's shape, G=8, bf16
(docs/benchmarks.md): 2.14 MB per computed token without checkpointing for the padded batch at P=2048 (39.5 GB)
and for ZoRRo at P=16384 (70.2 GB), against 2.18 estimated; with checkpointing at P=16384, 21.1 GB padded and
5.0 GB ZoRRo, against 19.9 and 4.4 estimated.
"""

from __future__ import annotations

USABLE_FRACTION = 0.85
"""Of the device's memory, what activations and weights may take: the allocator's fragmentation and the CUDA
context take the rest."""
WEIGHT_BYTES_PER_PARAM = 12
"""Weights in the model's dtype, fp32 gradients and master weights (DeepSpeed keeps both for 16-bit training)."""


def longest(args: dict) -> int:
    """The longest sequence of the bench's batch: the prompt, then each turn's response and reply (half as long)."""
    turns = args["turns"]
    return args["prompt_len"] + turns * args["response_len"] + (turns - 1) * (args["response_len"] // 2)


def tokens(args: dict, mode: str) -> int:
    """The tokens one fwd_bwd of a mode computes: the padded batch keeps every row at the longest sequence; ZoRRo
    computes each group's prompt once (a multi-turn batch: its unshared tokens, an upper bound)."""
    P, R, G, N, turns = args["prompt_len"], args["response_len"], args["group"], args["groups"], args["turns"]
    if mode == "naive" and args["baseline"] == "padded":
        return N * G * turns * longest(args)
    if mode == "zorro" and turns == 1:
        return N * (P + G * R)
    return sum(N * G * (P + t * R + t * (R // 2) + R) for t in range(turns))


def activation_bytes(config, computed: int, dtype_bytes: int, checkpointing: bool) -> int:
    text = config.get_text_config()
    hidden, layers = text.hidden_size, text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    per_layer = 8 * hidden + 4 * (q + kv) + 6 * text.intermediate_size
    kept = layers * hidden + per_layer if checkpointing else layers * per_layer
    return computed * kept * dtype_bytes


def plan(config, args: dict, device_bytes: int, params: int) -> dict:
    """The engine settings both modes run with (the same for both: they differ only in sharing), chosen for the
    more demanding mode unless the flags set them: no checkpointing if it fits, else checkpointing, else also a
    micro-batch budget; a SystemExit naming the flags when even one sequence per micro-batch cannot fit."""
    dtype_bytes = 4 if args["dtype"] == "float32" else 2
    available = USABLE_FRACTION * device_bytes - params * WEIGHT_BYTES_PER_PARAM
    need = {mode: tokens(args, mode) for mode in ("naive", "zorro")}

    def fits(checkpointing: bool, budget: int | None) -> bool:
        for computed in need.values():
            if activation_bytes(config, min(computed, budget or computed), dtype_bytes, checkpointing) > available:
                return False
        return True

    choice = args["gradient_checkpointing"]
    options = [False, True] if choice == "auto" else [choice == "on"]
    budget = args["micro_batch_tokens"]
    for checkpointing in options:
        if fits(checkpointing, budget):
            return _settings(config, args, need, dtype_bytes, checkpointing, budget)
    checkpointing = options[-1]
    if budget is not None:  # the budget asked for, even where the estimate says it will not fit
        return _settings(config, args, need, dtype_bytes, checkpointing, budget)
    budget = int(available / activation_bytes(config, 1, dtype_bytes, checkpointing)) // 1024 * 1024
    if budget < longest(args):
        raise SystemExit(f"--prompt-len {args['prompt_len']}: one sequence of {longest(args)} tokens needs about "
                         f"{activation_bytes(config, longest(args), dtype_bytes, checkpointing) / 1e9:.1f} GB "
                         f"of activations{' with' if checkpointing else ' without'} checkpointing, over the "
                         f"{available / 1e9:.1f} GB left on this device; pass a shorter --prompt-len, or "
                         f"--gradient-checkpointing on and --micro-batch-tokens explicitly to try anyway")
    return _settings(config, args, need, dtype_bytes, checkpointing, budget)


def _settings(config, args, need, dtype_bytes, checkpointing: bool, budget: int | None) -> dict:
    def estimate(mode):
        return activation_bytes(config, min(need[mode], budget or need[mode]), dtype_bytes, checkpointing) / 1e9

    return {"gradient_checkpointing": checkpointing, "micro_batch_tokens": budget,
            "estimate_gb": {mode: estimate(mode) for mode in need}}
