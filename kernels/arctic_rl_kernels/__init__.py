"""Attention kernels, each beside its plain PyTorch reference and parity test (split attention for ZoRRo)."""
