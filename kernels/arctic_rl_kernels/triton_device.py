"""Where this package's Triton kernels run: CUDA devices, and any device under Triton's interpreter
(`TRITON_INTERPRET=1` before triton is first imported: how their parity tests run without a GPU)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel) -> bool:
    """Whether `kernel` was defined under the interpreter (Triton decides when it decorates a function)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(device: torch.device, kernel, name: str) -> None:
    """Refuses, by name, a device `kernel` cannot run on."""
    if device.type != "cuda" and not interpreted(kernel):
        raise RuntimeError(f"{name}'s Triton kernel needs CUDA tensors; on {device.type} it runs only under the "
                           "Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), for tests")
    if interpreted(kernel) and not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was first imported: triton.language's own "
                           "functions are compiled ones, which the interpreter cannot call; set it before")


def on_device(device: torch.device):
    """Triton launches on torch's current CUDA device: a launch for tensors on another GPU runs inside this."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
