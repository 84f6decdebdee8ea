"""Import-only stub of torchtitan.distributed.utils (see torchtitan/__init__.py).

Imported at module import time by prime_rl.trainer.utils (clip_grad_norm_).
"""


def clip_grad_norm_(*args, **kwargs):
    raise NotImplementedError(
        "torchtitan.distributed.utils.clip_grad_norm_: torchtitan is an import-only stub in this environment"
    )
