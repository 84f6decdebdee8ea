"""`arctic-rl bench frameworks` (bench.py): frameworks alone against the same frameworks through Arctic RL."""

from arctic_rl_bench.frameworks.bench import add_arguments, main

__all__ = ["add_arguments", "main"]
