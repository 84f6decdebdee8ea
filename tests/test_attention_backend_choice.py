"""`zorro.attention_backend: auto`: the fastest split-attention backend measured on the device model
(`arctic-rl bench attention --save`), among those that run here and serve the layer's score rules."""

import argparse

import pytest
import torch

from arctic_rl_bench import attention as bench
from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_kernels import backend_timings
from arctic_rl_kernels import split_attention as sa

CPU = torch.device("cpu")


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
    # Measured faster; Triton on a CPU would run interpreted (tests set TRITON_INTERPRET=1): never auto's choice.
    assert sa.select_ops("auto", CPU, torch.float32) is sa.MATH
    assert sa.select_ops("auto", CPU, torch.bfloat16) is sa.CPU_FLASH  # a dtype not measured
    backend_timings.save(CPU, _record({"float32": {"cpu_flash": 2.0, "math": 4.0}}))
    assert sa.select_ops("auto", CPU, torch.float32) is sa.CPU_FLASH
    # A sliding window: the flash primitives cannot apply it, whatever their speed.
    assert sa.select_ops("auto", CPU, torch.float32, sa.ScoreMods(window=4)) is sa.MATH


def test_a_backend_that_cannot_run_here_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="cuda_flash split-attention backend runs ATen's CUDA kernels; this is cpu"):
        sa.select_ops("cuda_flash", CPU)
    assert "this is cuda" in sa.unusable("cpu_flash", torch.device("cuda"))
    with pytest.raises(InvalidRequest, match="zorro.attention_backend: the cuda_flash split-attention backend"):
        InProcessBackend({"model_path": str(tmp_path), "zorro": {"attention_backend": "cuda_flash"}})


def _bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = ["--prompt", "48", "--response", "8", "--group", "3", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
             "--repeats", "1", "--dtype", "float32", "bfloat16"]
    return bench.main(parser.parse_args([*small, *argv]))


def test_bench_attention_records_what_auto_reads(timings_dir, capsys):
    assert _bench("--save") == 0
    record = backend_timings.recorded(CPU)
    assert set(record["dtypes"]) == {"float32", "bfloat16"}
    for dtype, rows in record["dtypes"].items():
        assert set(rows) == {"cpu_flash", "math"}  # Triton runs interpreted here: not measured
        assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["max_rel_err"] <= bench.TOLERANCE[dtype] for r in rows.values())
        fastest = min(rows, key=lambda name: rows[name]["fwd_bwd_ms"])
        assert sa.auto_backend(CPU, getattr(torch, dtype)) == fastest
    assert record["command"].startswith("arctic-rl bench attention") and record["shape"]["group"] == 3


def test_bench_attention_saves_nothing_when_a_backend_is_wrong(timings_dir, monkeypatch, capsys):
    def off_by_a_percent(*args):
        out, lse = sa.CPU_FLASH.forward(*args)
        return out * 1.01, lse

    monkeypatch.setitem(sa.BACKENDS, "cpu_flash", sa.AttentionOps("cpu_flash", off_by_a_percent, sa.CPU_FLASH.backward, False))
    assert _bench("--save") == 1
    assert "cpu_flash (float32" in capsys.readouterr().err
    assert not timings_dir.exists()
