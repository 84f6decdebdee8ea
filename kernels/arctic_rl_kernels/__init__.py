"""Attention kernels, each beside its plain PyTorch reference and parity test: ZoRRo's split attention over a
prefix forest (parts on CPU primitives, or one fused Triton kernel) for training and log-probs, and forest
cascade attention for decoding."""
