"""On CPU, vLLM's sampler counts each token's rank without compiling a kernel for it.

vLLM's sampler ranks every sampled and prompt token it returns a log-prob for with `batched_count_greater_than`,
`(x >= values).sum(-1)` under `torch.compile`, which on a GPU spares a (tokens x vocabulary) mask. On CPU, every
process that runs an engine compiles it with Inductor at its first log-probs: dynamo's trace, a C++ build and
Inductor's ISA probes, each a Python process of its own, even when the kernel is in Inductor's cache. Every
Arctic RL sampler asks for log-probs, so every engine paid it: 6% of `make scenarios`'s profile, and 2.5 of a served
tiny job's 17.5 CPU s from start to stop with two log-probs requests (measured, 2-core Xeon). The eager expression
gives the same integers.

The loaders of `vllm_plain_weights`, vLLM's loaders on CPU here, apply it in the process that loads the model.
"""

from __future__ import annotations

import threading

import torch
from vllm.v1.sample import sampler

from arctic_rl_core.patches import Patch


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """For each row of `x`, how many of its elements are at least the row's value in `values` (rows x 1)."""
    return (x >= values).sum(-1)


EAGER_RANKS = Patch(sampler, "batched_count_greater_than", lambda compiled: count_at_least,
                    "on CPU the compiled rank count cost each engine process an Inductor build at its first "
                    "log-probs; the eager expression gives the same integers", by=__name__)
_ONCE = threading.Lock()


def use_eager_ranks() -> None:
    """Apply `EAGER_RANKS` in this process, unless an engine loaded before did (a process may run several)."""
    with _ONCE:
        if not EAGER_RANKS.active:
            EAGER_RANKS.apply()
