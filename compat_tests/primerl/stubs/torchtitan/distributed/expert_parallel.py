"""Import-only stub of torchtitan.distributed.expert_parallel (see torchtitan/__init__.py).

Names prime-rl imports at module import time:
  prime_rl.trainer.model                              -> ExpertParallel
  prime_rl.trainer.distributed.expert_parallel        -> ExpertParallel (subclassed)
  prime_rl.trainer.models.layers.moe                  -> expert_parallel (decorator, applied at import)
  prime_rl.trainer.models.layers.mxfp8_grouped_gemm   -> set_token_group_alignment_size_m
  prime_rl.trainer.models.layers.lora.multi_moe       -> TOKEN_GROUP_ALIGN_SIZE_M (lazily)
"""

import functools

from torch.distributed.tensor.parallel import ParallelStyle

TOKEN_GROUP_ALIGN_SIZE_M = 8


def _unavailable(what):
    raise NotImplementedError(
        f"{what}: torchtitan is an import-only stub in this environment "
        "(prime-rl pins torchtitan@23e4dfc from GitHub, which is not on PyPI)"
    )


def set_token_group_alignment_size_m(alignment_size):
    global TOKEN_GROUP_ALIGN_SIZE_M
    TOKEN_GROUP_ALIGN_SIZE_M = alignment_size


def expert_parallel(func):
    """Decorator; the decorated expert kernel raises when called."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        _unavailable(f"torchtitan expert_parallel({func.__qualname__})")

    return wrapper


class ExpertParallel(ParallelStyle):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def _token_dispatch(self, mod, inputs, device_mesh):
        _unavailable("ExpertParallel._token_dispatch")

    def _token_combine(self, mod, routed_output, device_mesh):
        _unavailable("ExpertParallel._token_combine")

    def _apply(self, module, device_mesh):
        _unavailable("ExpertParallel._apply")
