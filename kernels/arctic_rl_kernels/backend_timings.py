"""Measured speeds of the split-attention backends, one file per device model, read by `auto`.

`arctic-rl bench attention --save` times every backend that runs on a device, side by side on one forest,
and writes `timings/<device model>.json` (a GPU's name, a CPU's model name); `auto` then runs the fastest one that serves a layer (as vLLM ships
tuned kernel configurations per device name). A device without a file gets the fixed order in
`split_attention.py`.
"""

from __future__ import annotations

import functools
import json
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
    """The saved record for this device model, or {}."""
    return _load(device)


def fastest(device: torch.device, dtype: torch.dtype, candidates: list[str]) -> str | None:
    """The candidate with the smallest measured forward+backward time for this device model and dtype,
    or None when none of them was measured."""
    times = recorded(device).get("dtypes", {}).get(dtype_key(dtype), {})
    timed = [(times[name]["fwd_bwd_ms"], name) for name in candidates if name in times]
    return min(timed)[1] if timed else None


def save(device: torch.device, record: dict) -> Path:
    TIMINGS_DIR.mkdir(parents=True, exist_ok=True)
    path = TIMINGS_DIR / f"{device_key(device)}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
    return path
