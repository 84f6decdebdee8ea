"""torch.distributed set-up for the training engine.

Under a launcher (deepspeed, torchrun, Ray) the rendezvous variables are
already set. Run directly, we are a world of one: fill them in, with a free
loopback port, so DeepSpeed can initialise. CPU machines use DeepSpeed's CPU
accelerator and gloo; GPU machines NCCL.
"""

from __future__ import annotations

import os
import socket

from arctic_rl_core.patches import environment_default, set_item


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A port free on every interface of this machine (for a rendezvous other machines reach)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


_SHM_ALL_REDUCE = "deepspeed_shm_comm"  # DeepSpeed's op builder name

RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def standalone_env() -> dict[str, str]:
    """This process's environment for a child that must be a world of its own, not join our rendezvous."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}


def select_accelerator() -> None:
    """Tell DeepSpeed to use its CPU accelerator where there is no GPU.

    Must run before deepspeed is first imported (transformers imports it too):
    otherwise DeepSpeed guesses, and prints its guess on stdout.
    """
    import torch

    if not torch.cuda.is_available():
        environment_default("DS_ACCELERATOR", "cpu", "DeepSpeed: use its CPU accelerator (no GPU here)", __name__)


def init_distributed() -> None:
    select_accelerator()
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        why = "torch.distributed: a one-rank world of this process, on loopback"
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", str(free_loopback_port()))):
            environment_default(name, value, why, __name__)
    if not torch.cuda.is_available() and deepspeed.ops.__compatible_ops__.get(_SHM_ALL_REDUCE):
        # DeepSpeed's CPU backend compiles its shared-memory all-reduce (a C++ extension: 1-2 minutes on a small
        # machine, again whenever torch or the environment's path changes) at its first init_distributed. Only its
        # inference_all_reduce uses it, which training never calls; the collectives we use are gloo's.
        set_item(deepspeed.ops.__compatible_ops__, _SHM_ALL_REDUCE, False, "DeepSpeed: do not compile the "
                 "shared-memory all-reduce (only inference_all_reduce uses it)", __name__, "deepspeed.ops.__compatible_ops__")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
