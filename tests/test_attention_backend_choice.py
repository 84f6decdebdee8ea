"""`zorro.attention_backend: auto`: the fastest split-attention backend measured on the device model
(`arctic-rl bench attention --save`), among those that run here and serve the layer's score rules.

The file runs on a CPU (with or without Triton's interpreter) and on CUDA: what "here" lacks and runs is
read from the device the backend and the bench pick, not assumed."""

import argparse
import dataclasses
import re

import pytest
import torch

from arctic_rl_bench import attention as bench
from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_kernels import backend_timings
from arctic_rl_kernels import split_attention as sa

CPU = torch.device("cpu")
HERE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""The device `arctic-rl bench attention` and the engine run on."""
DEVICE_FLASH = "cuda_flash" if HERE.type == "cuda" else "cpu_flash"
"""This device's own flash primitives: the backend that runs here and nowhere else."""


@pytest.fixture
def timings_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(backend_timings, "TIMINGS_DIR", tmp_path / "timings")
    backend_timings._load.cache_clear()
    yield tmp_path / "timings"
    backend_timings._load.cache_clear()


def _record(times: dict) -> dict:
    return {"dtypes": {dtype: {name: {"fwd_ms": ms / 3, "fwd_bwd_ms": ms} for name, ms in rows.items()}
                       for dtype, rows in times.items()}}


def test_auto_runs_the_fastest_measured_backend_that_serves_the_layer(timings_dir):
    assert sa.auto_backend(CPU, torch.float32) == "cpu_flash"  # no timings: the fixed order
    backend_timings.save(CPU, _record({"float32": {"cpu_flash": 9.0, "math": 4.0, "triton": 1.0}}))
    # Measured faster; Triton on a CPU runs interpreted if at all: never auto's choice there.
    assert sa.select_ops("auto", CPU, torch.float32) is sa.MATH
    assert sa.select_ops("auto", CPU, torch.bfloat16) is sa.CPU_FLASH  # a dtype not measured
    backend_timings.save(CPU, _record({"float32": {"cpu_flash": 2.0, "math": 4.0}}))
    assert sa.select_ops("auto", CPU, torch.float32) is sa.CPU_FLASH
    # A sliding window: the flash primitives cannot apply it, whatever their speed.
    assert sa.select_ops("auto", CPU, torch.float32, sa.ScoreMods(window=4)) is sa.MATH


def test_a_backend_that_cannot_run_here_is_refused_by_name(tmp_path):
    # Each device's flash primitives refuse the other device type (a rule on the type: no such device needed).
    assert "runs ATen's CUDA kernels; this is cpu" in sa.unusable("cuda_flash", CPU)
    assert "runs ATen's CPU kernels; this is cuda" in sa.unusable("cpu_flash", torch.device("cuda"))
    missing = {name: reason for name in sa.BACKENDS if (reason := sa.unusable(name, HERE)) is not None}
    assert ("cpu_flash" if HERE.type == "cuda" else "cuda_flash") in missing  # one device type's kernels always
    for name, reason in missing.items():
        with pytest.raises(ValueError, match=re.escape(f"the {name} split-attention backend {reason}")):
            sa.select_ops(name, HERE)
        # The engine refuses it at start-up, by field, before reading any weight (the folder is empty).
        with pytest.raises(InvalidRequest, match=f"zorro.attention_backend: the {name} split-attention backend"):
            InProcessBackend({"model_path": str(tmp_path), "zorro": {"attention_backend": name}})


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = ["--prompt", "48", "--response", "8", "--group", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--repeats", "1", "--dtype", "float32", "bfloat16"]
    return bench.main(parser.parse_args([*small, *argv]))


def test_bench_attention_records_what_auto_reads(timings_dir, capsys):
    assert _bench("--save") == 0
    record = backend_timings.recorded(HERE)
    assert set(record["dtypes"]) == {"float32", "bfloat16"}
    # Triton is measured only compiled, on CUDA: under the interpreter its timings mean nothing.
    expected = {"math", DEVICE_FLASH} | ({"triton"} if HERE.type == "cuda" and sa.triton_usable(HERE) else set())
    for dtype, rows in record["dtypes"].items():
        assert set(rows) == expected
        assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["max_rel_err"] <= bench.TOLERANCE[dtype] for r in rows.values())
        fastest = min(rows, key=lambda name: rows[name]["fwd_bwd_ms"])
        assert sa.auto_backend(HERE, getattr(torch, dtype)) == fastest
    assert record["command"].startswith("arctic-rl bench attention") and record["shape"]["group"] == 3


def test_bench_attention_saves_nothing_when_a_backend_is_wrong(timings_dir, monkeypatch, capsys):
    real = sa.BACKENDS[DEVICE_FLASH]

    def off_by_a_percent(*args):
        out, lse = real.forward(*args)
        return out * 1.01, lse

    monkeypatch.setitem(sa.BACKENDS, DEVICE_FLASH, dataclasses.replace(real, forward=off_by_a_percent))
    assert _bench("--save") == 1
    assert f"{DEVICE_FLASH} (float32" in capsys.readouterr().err
    assert not timings_dir.exists()
