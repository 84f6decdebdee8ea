"""Measured speeds of the split-attention backends and tuned Triton tile configurations, one file per device
model, read by `auto` and by the fused kernel.

`arctic-rl bench attention --save` times every backend that runs on a device, side by side on one forest,
and records them in `timings/<device model>.json` (a GPU's name, a CPU's model name) under the shape's dtype,
head size and longest sequence; `--sweep` records several lengths in one run. `auto` then runs the backend
that was fastest at the measured length nearest the call's (as vLLM ships tuned kernel configurations per
device name): which backend wins changes with length (on an H100 the fused kernel wins at 2K tokens and
loses at 32K). `--tune` records, per dtype and head size, the tile sizes the fused kernel's three kernels ran
fastest with. A device without a file gets the fixed order in `split_attention.py`, and the tiles tuned on a
device of its compute capability or else the kernel's default tiles.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import re
from pathlib import Path

import torch

TIMINGS_DIR = Path(__file__).with_name("timings")


def device_name(device: torch.device) -> str:
    """The device model: the CUDA device's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return f"{device.type} {platform.machine()}"


def device_key(device: torch.device) -> str:
    """The timings file's name for the device model ('NVIDIA_H100_80GB_HBM3')."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name(device)).strip("_")


def dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _load(device: torch.device) -> dict:
    # Once per device: every attention layer's call asks.
    path = TIMINGS_DIR / f"{device_key(device)}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def recorded(device: torch.device) -> dict:
    """The saved record for this device model, or {}: {"measurements": [...], "kernels": {...}}."""
    return _load(device)


def last_measured(device: torch.device) -> str | None:
    """The date of the newest backend measurement for this device model."""
    return max((m["date"] for m in recorded(device).get("measurements", [])), default=None)


def fastest(device: torch.device, dtype: torch.dtype, candidates: list[str], head_dim: int, longest: int) -> str | None:
    """The candidate with the smallest forward+backward time measured for this device model and dtype, at the
    measured length nearest `longest` (by ratio) among those of this head size (or of any head size where
    this one was not measured); None when none of the candidates was measured."""
    rows = [m for m in recorded(device).get("measurements", [])
            if m["dtype"] == dtype_key(dtype) and any(name in m["backends"] for name in candidates)]
    rows = [m for m in rows if m["head_dim"] == head_dim] or rows
    if not rows:
        return None
    nearest = min(rows, key=lambda m: abs(math.log(m["longest"] / max(longest, 1))))
    times = nearest["backends"]
    return min((times[name]["fwd_bwd_ms"], name) for name in candidates if name in times)[1]


def capability(device: torch.device) -> str | None:
    """A CUDA device's compute capability ('9.0'): devices that share it share the SM, its shared memory and
    registers, so tiles that fit and run well on one fit the other."""
    if device.type != "cuda":
        return None
    return "{}.{}".format(*torch.cuda.get_device_capability(device))


@functools.cache
def _every_record(directory: Path) -> tuple[dict, ...]:
    # Once per folder: read only where a device model has no tiles of its own, but then on every layer's call.
    return tuple(json.loads(path.read_text()) for path in sorted(directory.glob("*.json")))


def tuned_tiles(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict | None:
    """The fused kernel's tile configuration `--tune` found fastest for this device model, dtype and head size:
    {"forward": {...}, "dkdv": {...}, "dq": {...}}, each BLOCK_M, BLOCK_N, num_warps, num_stages (dK/dV's maybe
    ATOMIC_DQ); or None. A model with none takes those tuned on another of its compute capability (an H200 the
    H100's: one SM design), else None (the kernel's default tiles)."""
    def entry_of(record: dict) -> dict | None:
        return record.get("kernels", {}).get(dtype_key(dtype), {}).get(str(head_dim))

    entry = entry_of(recorded(device))
    wanted = capability(device) if entry is None else None
    if wanted is not None:
        entry = next((entry_of(r) for r in _every_record(TIMINGS_DIR)
                      if r.get("capability") == wanted and entry_of(r) is not None), None)
    return None if entry is None else {kernel: entry[kernel] for kernel in ("forward", "dkdv", "dq")}


def _write(device: torch.device, record: dict) -> Path:
    TIMINGS_DIR.mkdir(parents=True, exist_ok=True)
    path = TIMINGS_DIR / f"{device_key(device)}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
    _every_record.cache_clear()
    return path


def save_measurements(device: torch.device, measurements: list[dict]) -> Path:
    """Adds measurements ({dtype, head_dim, longest, backends, ...}) to the device's file, replacing any of the
    same dtype, head size and length; the others are kept."""
    record = dict(recorded(device))
    record["device"] = device_name(device)
    record["capability"] = capability(device)
    fresh = {(m["dtype"], m["head_dim"], m["longest"]) for m in measurements}
    kept = [m for m in record.get("measurements", []) if (m["dtype"], m["head_dim"], m["longest"]) not in fresh]
    record["measurements"] = sorted(kept + measurements, key=lambda m: (m["dtype"], m["head_dim"], m["longest"]))
    return _write(device, record)


def save_tiles(device: torch.device, dtype: torch.dtype, head_dim: int, entry: dict) -> Path:
    """Records the fused kernel's tuned tiles for one dtype and head size ({forward, dkdv, dq, ...})."""
    record = dict(recorded(device))
    record["device"] = device_name(device)
    record["capability"] = capability(device)
    kernels = {d: dict(sizes) for d, sizes in record.get("kernels", {}).items()}
    kernels.setdefault(dtype_key(dtype), {})[str(head_dim)] = entry
    record["kernels"] = kernels
    return _write(device, record)
