"""Reading DeepSpeed checkpoints without running code from them.

DeepSpeed's own loader calls `torch.load(weights_only=False)`: a crafted
`*_states.pt` file would run code in the trainer. The engine reads every file
through `safe_load` instead (`weights_only=True`: plain containers, tensors and
the three DeepSpeed value classes its ZeRO states hold, nothing callable), and
`preflight` reads them all and checks every parameter shape *before* DeepSpeed
touches the model, so a checkpoint that is unsafe, corrupt or of another model
is refused with the training state as it was.
"""

from __future__ import annotations

import glob
import os

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from arctic_rl_core.errors import InvalidRequest


def _deepspeed_value_classes() -> list[type]:
    # Plain records (an enum, a named tuple, a loss-scale holder): building them runs no code of the file's choosing.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str, map_location=None, mmap: bool = False):
    """`torch.load` that refuses anything but data; errors name the file."""
    try:
        with torch.serialization.safe_globals(_deepspeed_value_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # UnpicklingError for code, RuntimeError/EOFError for corrupt files
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "Unsupported global" in str(err):
            reason = next(line.strip() for line in str(err).splitlines() if "Unsupported global" in line)
        raise InvalidRequest("path", f"{path} is not a safe Arctic RL checkpoint file: {reason}") from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading through `safe_load`."""

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


def preflight(directory: str, expected_shapes: dict[str, tuple[int, ...]]) -> None:
    """Read every state file of a checkpoint safely and check it holds this model's parameters."""
    if os.path.islink(directory) or not os.path.isdir(directory):
        raise InvalidRequest("path", f"{directory!r} holds no Arctic RL checkpoint")
    files = sorted(glob.glob(os.path.join(directory, "*.pt")))
    model_files = [f for f in files if f.endswith("model_states.pt")]
    if not model_files:
        raise InvalidRequest("path", f"{directory!r} holds no model states file")
    for file in files:
        if os.path.islink(file) or not os.path.isfile(file):
            raise InvalidRequest("path", f"{file} is not a regular file")
        state = safe_load(file, map_location="cpu", mmap=True)
        if file in model_files:
            _check_shapes(file, state, expected_shapes)


def _check_shapes(file: str, state, expected: dict[str, tuple[int, ...]]) -> None:
    if not isinstance(state, dict):
        raise InvalidRequest("path", f"{file} is not a DeepSpeed model states file")
    groups, module = state.get("param_shapes"), state.get("module")
    if isinstance(groups, list):  # ZeRO stages 1-3 record every trainable parameter's full shape
        found = {name: tuple(shape) for group in groups if isinstance(group, dict) for name, shape in group.items()}
    elif isinstance(module, dict):  # stage 0 saves the module's tensors whole
        found = {name: tuple(t.shape) for name, t in module.items() if name in expected}
    else:
        raise InvalidRequest("path", f"{file} records no parameter shapes")
    if found.keys() != expected.keys():
        missing = sorted(expected.keys() - found.keys())
        extra = sorted(found.keys() - expected.keys())
        raise InvalidRequest("path", f"{file} is a checkpoint of another model (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in expected.items():
        if found[name] != shape:
            raise InvalidRequest("path", f"{file} is a checkpoint of another model: {name} has shape {found[name]}, "
                                         f"this model's is {shape}")
