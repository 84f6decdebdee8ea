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
from arctic_rl_kernels.layout import ForestLayout
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


def _measured(times: dict, longest: int = 2304, head_dim: int = 128) -> list[dict]:
    return [{"dtype": dtype, "head_dim": head_dim, "longest": longest, "date": "2026-11-26",
             "backends": {name: {"fwd_ms": ms / 3, "fwd_bwd_ms": ms} for name, ms in rows.items()}}
            for dtype, rows in times.items()]


def test_auto_runs_the_fastest_measured_backend_that_serves_the_layer(timings_dir):
    assert sa.auto_backend(CPU, torch.float32) == "cpu_flash"  # no timings: the fixed order
    backend_timings.save_measurements(CPU, _measured({"float32": {"cpu_flash": 9.0, "math": 4.0, "triton": 1.0}}))
    # Measured faster; Triton on a CPU runs interpreted if at all: never auto's choice there.
    assert sa.select_ops("auto", CPU, torch.float32) is sa.MATH
    assert sa.select_ops("auto", CPU, torch.bfloat16) is sa.CPU_FLASH  # a dtype not measured
    backend_timings.save_measurements(CPU, _measured({"float32": {"cpu_flash": 2.0, "math": 4.0}}))
    assert sa.select_ops("auto", CPU, torch.float32) is sa.CPU_FLASH  # the same shape's measurement replaced
    # A sliding window: the flash primitives cannot apply it, whatever their speed.
    assert sa.select_ops("auto", CPU, torch.float32, sa.ScoreMods(window=4)) is sa.MATH


def test_auto_picks_by_the_measured_length_nearest_the_forests(timings_dir):
    # Which backend wins changes with length (the fused kernel wins at 2K tokens on an H100 and loses at 32K).
    backend_timings.save_measurements(CPU, _measured({"float32": {"cpu_flash": 1.0, "math": 4.0}}, longest=2304)
                                      + _measured({"float32": {"cpu_flash": 9.0, "math": 4.0}}, longest=36864))
    assert [m["longest"] for m in backend_timings.recorded(CPU)["measurements"]] == [2304, 36864]
    picks = {n: sa.auto_backend(CPU, torch.float32, longest=n) for n in (300, 4000, 9000, 20000, 100000)}
    assert picks == {300: "cpu_flash", 4000: "cpu_flash", 9000: "cpu_flash", 20000: "math", 100000: "math"}
    # A head size measured is preferred; one not measured reads the others.
    backend_timings.save_measurements(CPU, _measured({"float32": {"cpu_flash": 9.0, "math": 4.0}}, longest=2304, head_dim=64))
    assert sa.auto_backend(CPU, torch.float32, head_dim=64, longest=2304) == "math"
    assert sa.auto_backend(CPU, torch.float32, head_dim=128, longest=2304) == "cpu_flash"
    assert sa.auto_backend(CPU, torch.float32, head_dim=256, longest=2304) in {"cpu_flash", "math"}
    # The split-attention call passes its forest's longest sequence and head size.
    layout = ForestLayout.groups([30000], [[4000, 6000]])
    assert layout.longest == 36000 and ForestLayout.unshared([5, 9, 2]).longest == 9
    q = torch.randn(2, layout.num_tokens, 128)
    seen = {}
    real = sa.select_ops

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sa, "select_ops", spy)
        mp.setattr(sa._SplitAttention, "apply", lambda *args: None)
        sa.split_attention(q, q, q, layout, 1.0)
    assert seen["head_dim"] == 128 and seen["longest"] == 36000


def test_without_timings_fp32_on_cuda_never_picks_the_fused_kernel(monkeypatch):
    # IEEE fp32 without tensor cores: 69x slower than ATen's kernels at 2K tokens on an H100 (no GPU needed to
    # ask: the choice reads the device type and the timings).
    monkeypatch.setattr(backend_timings, "fastest", lambda *args: None)
    monkeypatch.setattr(sa, "triton_usable", lambda device: True)
    cuda = torch.device("cuda")
    assert sa.auto_backend(cuda, torch.float32) == "cuda_flash"
    assert sa.auto_backend(cuda, torch.float32, sa.ScoreMods(window=4)) == "math"
    assert sa.auto_backend(cuda, torch.bfloat16) == "triton"
    assert sa.auto_backend(cuda, torch.bfloat16, sa.ScoreMods(window=4)) == "triton"


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
    assert _bench("--save", "--sweep", "24", "48") == 0
    measurements = backend_timings.recorded(HERE)["measurements"]
    assert {(m["dtype"], m["longest"]) for m in measurements} == {(d, n) for d in ("float32", "bfloat16") for n in (27, 54)}
    # Triton is measured only compiled, on CUDA: under the interpreter its timings mean nothing.
    expected = {"math", DEVICE_FLASH} | ({"triton"} if HERE.type == "cuda" and sa.triton_usable(HERE) else set())
    for m in measurements:
        rows = m["backends"]
        assert set(rows) == expected and m["head_dim"] == 16 and m["shape"]["prompt"] in (24, 48)
        assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["max_rel_err"] <= bench.TOLERANCE[m["dtype"]]
                   for r in rows.values())
        fastest = min(rows, key=lambda name: rows[name]["fwd_bwd_ms"])
        assert sa.auto_backend(HERE, getattr(torch, m["dtype"]), head_dim=16, longest=m["longest"]) == fastest
        assert m["command"].startswith("arctic-rl bench attention") and m["shape"]["group"] == 3
    assert backend_timings.last_measured(HERE) == measurements[0]["date"]
    # Saving one length again replaces it and keeps the other.
    assert _bench("--save", "--sweep", "48", "--dtype", "float32") == 0
    assert len(backend_timings.recorded(HERE)["measurements"]) == 4


def test_tiles_are_tuned_kernel_by_kernel_and_recorded_per_dtype_and_head_size(timings_dir, monkeypatch):
    """`--tune`'s search on the kernels as they run here (interpreted on a CPU: the choice's logic, not its
    timings), with a candidate that is wrong and one that cannot launch: both are dropped with their reason."""
    if not sa.triton_usable(HERE):
        pytest.fail("the fused kernel runs here only under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from arctic_rl_kernels import forest_flash_attention as ffa

    candidates = {"forward": [(16, 16, 4, 1), (32, 16, 4, 1)], "dq": [(32, 16, 4, 1), (16, 0, 4, 1)],
                  "dkdv": [(16, 32, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1, True)]}
    monkeypatch.setattr(bench, "TILE_CANDIDATES", candidates)
    spec = {"prompt": 40, "response": 8, "group": 2, "groups": 1, "heads": 4, "kv_heads": 2, "head_dim": 16, "repeats": 1}
    real_forward = ffa.forest_attention_forward

    def wrong_with_wide_query_tiles(*args):
        out, lse = real_forward(*args)
        return (out * 1.5, lse) if args[-1]["forward"]["BLOCK_M"] == 32 else (out, lse)

    monkeypatch.setattr(ffa, "forest_attention_forward", wrong_with_wide_query_tiles)
    result = bench.tune(spec, "float32", HERE)
    trials = result["trials"]
    # Each kernel's default tiles are timed first (16x16 under the interpreter), then the candidates not the same.
    default = {kernel: (t["BLOCK_M"], t["BLOCK_N"], t["num_warps"], t["num_stages"])
               for kernel, t in ffa.default_tiles(HERE, torch.float32, 16).items()}
    expected = {kernel: [tuple(c) for c in dict.fromkeys([default[kernel] + ((False,) if kernel == "dkdv" else ()),
                                                          *[(*c, False)[:5] if kernel == "dkdv" else c for c in cs]])]
                for kernel, cs in candidates.items()}
    tried = {kernel: [tuple(r[key] for key in bench.TILE_KEYS if key in r) for r in rows] for kernel, rows in trials.items()}
    assert tried == expected
    assert [r["ATOMIC_DQ"] for r in trials["dkdv"]][-1] is True and all("ms" in r for r in trials["dkdv"])
    wide = tried["forward"].index((32, 16, 4, 1))
    assert "differs from the default tiles" in trials["forward"][wide]["error"] and "error" in trials["dq"][-1]
    assert result["tiles"]["forward"]["BLOCK_M"] != 32
    for kernel in ("dkdv", "dq"):  # the fastest of those timed
        timed = [r for r in trials[kernel] if "ms" in r]
        fastest = min(timed, key=lambda r: r["ms"])
        keys = ("BLOCK_M", "BLOCK_N", "ATOMIC_DQ") if kernel == "dkdv" else ("BLOCK_M", "BLOCK_N")
        assert [result["tiles"][kernel][key] for key in keys] == [fastest[key] for key in keys]
    backend_timings.save_tiles(HERE, torch.float32, 16, {**result["tiles"], "date": "2026-11-26"})
    assert backend_timings.tuned_tiles(HERE, torch.float32, 16) == result["tiles"]
    assert backend_timings.tuned_tiles(HERE, torch.float32, 64) is None


def test_bench_attention_saves_nothing_when_a_backend_is_wrong(timings_dir, monkeypatch, capsys):
    real = sa.BACKENDS[DEVICE_FLASH]

    def off_by_a_percent(*args):
        out, lse = real.forward(*args)
        return out * 1.01, lse

    monkeypatch.setitem(sa.BACKENDS, DEVICE_FLASH, dataclasses.replace(real, forward=off_by_a_percent))
    assert _bench("--save") == 1
    assert f"{DEVICE_FLASH} (float32" in capsys.readouterr().err
    assert not timings_dir.exists()


def test_a_gpu_without_tuned_tiles_takes_those_of_its_compute_capability(timings_dir, monkeypatch):
    """An H200 has no file of its own; the H100's tiles were tuned on the same SM (sm_90: shared memory and
    registers), so the H200 runs them. A GPU of another capability keeps the default tiles; its own file, once
    tuned, wins over another's."""
    cuda = torch.device("cuda")
    names = {"now": "NVIDIA H100 80GB HBM3"}
    caps = {"NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H200": "9.0", "NVIDIA A100-SXM4-80GB": "8.0"}
    monkeypatch.setattr(backend_timings, "device_name", lambda device: names["now"])
    monkeypatch.setattr(backend_timings, "capability", lambda device: caps[names["now"]])
    h100 = {"forward": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
            "dkdv": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "ATOMIC_DQ": False},
            "dq": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}
    backend_timings.save_tiles(cuda, torch.bfloat16, 128, {**h100, "date": "2026-11-26"})
    assert backend_timings.recorded(cuda)["capability"] == "9.0"
    for name, expected in (("NVIDIA H200", h100), ("NVIDIA A100-SXM4-80GB", None)):
        names["now"] = name
        backend_timings._load.cache_clear()
        assert backend_timings.tuned_tiles(cuda, torch.bfloat16, 128) == expected, name
        assert backend_timings.tuned_tiles(cuda, torch.bfloat16, 64) is None
    names["now"] = "NVIDIA H200"
    own = {**h100, "forward": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}}
    backend_timings.save_tiles(cuda, torch.bfloat16, 128, {**own, "date": "2026-11-27"})
    assert backend_timings.tuned_tiles(cuda, torch.bfloat16, 128) == own
