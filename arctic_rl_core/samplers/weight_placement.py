"""Where each of the trainer's weights lives inside vLLM's model, so a sync can write it there itself.

vLLM fuses some checkpoint tensors into one parameter (`packed_modules_mapping`,
e.g. q/k/v_proj into qkv_proj, stacked along dim 0 in that order) and pads the
vocabulary rows of its embeddings. A placement maps each checkpoint name to a
row range of one vLLM parameter. It is built once, from the checkpoint's names
and shapes, and must cover every vLLM parameter exactly; anything it cannot
place (a renamed layer, a quantized or sharded parameter) makes it fail with
the reason, and the sampler then loads through vLLM's own `load_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Slice:
    param: str
    first_row: int
    rows: int


def _fused(name: str, packed: dict[str, list[str]]) -> tuple[str, list[str]] | None:
    """(vLLM name, the checkpoint names of all its shards in order) when `name` is a shard of a fused parameter."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        for fused, shards in packed.items():
            if part in shards:
                return (".".join(parts[:i] + [fused] + parts[i + 1:]),
                        [".".join(parts[:i] + [shard] + parts[i + 1:]) for shard in shards])
    return None


def place(checkpoint: dict[str, tuple[int, ...]], params: dict[str, tuple[int, ...]],
          packed: dict[str, list[str]]) -> dict[str, Slice]:
    """Map checkpoint names (with shapes) onto vLLM's parameters (with shapes)."""
    placement: dict[str, Slice] = {}
    covered: dict[str, int] = {}
    fused_targets = set()
    for name, shape in checkpoint.items():
        fused = _fused(name, packed)
        if fused is None:
            target, first_row = name, 0
        else:
            target, shard_names = fused
            missing = [s for s in shard_names if s not in checkpoint]
            if missing:
                raise PlacementError(f"{name}: fused into {target} with {missing}, which the checkpoint lacks")
            first_row = sum(checkpoint[s][0] for s in shard_names[: shard_names.index(name)])
            fused_targets.add(target)
        if target not in params:
            raise PlacementError(f"{name}: vLLM's model has no parameter {target}")
        target_shape = params[target]
        if len(shape) == 0 or tuple(shape[1:]) != tuple(target_shape[1:]) or first_row + shape[0] > target_shape[0]:
            raise PlacementError(f"{name}: shape {list(shape)} does not fit rows {first_row}.. of {target} "
                                 f"{list(target_shape)}")
        placement[name] = Slice(target, first_row, shape[0])
        covered[target] = covered.get(target, 0) + shape[0]
    for target, shape in params.items():
        rows = covered.get(target, 0)
        # A fused parameter is covered row for row; others may keep padding rows (vocabulary padding).
        if rows == 0 or target in fused_targets and rows != shape[0]:
            raise PlacementError(f"vLLM parameter {target} {list(shape)} is not covered by the checkpoint "
                                 f"({rows} rows placed)")
    return placement


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in a model directory's safetensors files (headers only)."""
    import glob
    import os

    from safetensors import safe_open

    shapes = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise PlacementError(f"{model_path} holds no safetensors files")
    return shapes


def destinations(placement: dict[str, Slice], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of vLLM's parameter tensors, one per checkpoint name, each shaped like the checkpoint tensor."""
    return {name: tensors[s.param].narrow(0, s.first_row, s.rows) for name, s in placement.items()}
