"""Every Triton kernel configuration the product launches by default, compiled for Hopper (`sm_90a`) with Triton's
own compiler, no GPU needed (`arctic_rl_kernels.compile_check`): each must fit an SM's 227 KiB of shared memory,
and the 16-bit ones must not spill registers. A configuration that does not fit fails here, in `make test`, not
at the first backward on a GPU.

Compiles are a second or so each, all made once for the module in two processes. fp32's registers are not held
to a limit (fp32 is never the fused kernel's choice on a GPU), so those are compiled only as far as Triton's
shared-memory allocation: lowering their FMA dots through LLVM and ptxas takes up to a minute each. Under the
interpreter (`TRITON_INTERPRET=1`, tests/conftest.py) the compiles run in fresh processes without it.
"""

import json

import pytest

from arctic_rl_kernels import compile_check as cc
from arctic_rl_kernels.backend_timings import TIMINGS_DIR

HEAD_SIZES = [(64, 64), (128, 128), (256, 256), (192, 128)]
"""(D, DV): the common head sizes, and MLA's (DeepSeek: 192 for queries and keys, 128 for values)."""
MODS_AT = {128, 256}
"""Head sizes whose families use windows and softcaps (Gemma 2's are 256)."""
def _forest_defaults() -> list[cc.Config]:
    configs = []
    for dtype in ("bfloat16", "float32"):
        for d, dv in HEAD_SIZES:
            for mods in (False, True) if dtype != "float32" and d in MODS_AT else (False,):
                configs += cc.forest_configs(dtype, d, dv, softcap=mods, window=mods, groups=4)
                if dtype != "float32":
                    # With one query head per KV head, dK/dV's loop over a KV head's query heads is compiled away:
                    # another kernel.
                    configs += [c for c in cc.forest_configs(dtype, d, dv, softcap=mods, window=mods, groups=1)
                                if c.kernel == "dkdv"]
    return configs


def _tuned() -> list[cc.Config]:
    """The tiles `--tune` recorded in the shipped timings files (looked up by head size, so D = DV here)."""
    configs = []
    for path in sorted(TIMINGS_DIR.glob("*.json")):
        for dtype, sizes in json.loads(path.read_text()).get("kernels", {}).items():
            for head_dim, entry in sizes.items():
                configs += cc.forest_configs(dtype, int(head_dim), tiles=entry, groups=4)
    return configs


def _cascade_defaults() -> list[cc.Config]:
    configs = [c for dtype in ("bfloat16", "float32") for d in (64, 128, 256) for c in cc.cascade_configs(dtype, d)]
    return configs + [c for c in cc.cascade_configs("bfloat16", 128, paged=False) if c.kernel == "cascade_partials"]


def _controls() -> list[cc.Config]:
    """Configurations that must be refused: the old dK/dV default (spills) and 64x64 fp32 at head size 256 (too
    much shared memory)."""
    tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}
    return [cc.Config("dkdv", "bfloat16", 128, 128, {**tile, "num_stages": 3}, groups=4),
            cc.Config("dq", "float32", 256, 256, {**tile, "num_stages": 2}, groups=4)]


@pytest.fixture(scope="module")
def measured():
    sets = {"defaults": _forest_defaults(), "tuned": _tuned(), "cascade": _cascade_defaults(), "controls": _controls()}
    # The 16-bit defaults' shared memory again, read the fast way fp32's is (compiled only as far as Triton's
    # shared-memory allocation): it must agree with the full compile's.
    sets["shared_only"] = [c for c in sets["defaults"] if c.dtype != "float32"]
    configs = [c for group in sets.values() for c in group]
    wanted = [name != "shared_only" and c.dtype != "float32" for name, group in sets.items() for c in group]
    usages = iter(cc.usage(configs, jobs=2, registers=wanted))
    return {name: [(c, next(usages)) for c in group] for name, group in sets.items()}


def _problems(pairs):
    return cc.unfit([c for c, _ in pairs], [u for _, u in pairs])


def test_default_forest_kernel_tiles_fit_hopper(measured):
    problems = _problems(measured["defaults"])
    assert not problems, "default tiles that do not fit sm_90a (default_tiles):\n" + "\n".join(problems)


def test_tuned_tiles_fit_hopper(measured):
    """Tuned tiles were timed on their device with its Triton (`--tune`): a register spill there was part of the
    time that won, so only shared memory, which no compiler can trade away, is held to the limit here."""
    if not measured["tuned"]:
        pytest.fail("no tuned tiles are shipped in arctic_rl_kernels/timings (the H100's should be)")
    over = [(c, u) for c, u in measured["tuned"] if u.shared_bytes > cc.HOPPER_SHARED_BYTES]
    assert not over, "tuned tiles over sm_90a's shared memory (timings/*.json):\n" + "\n".join(_problems(over))


def test_cascade_decode_default_launch_fits_hopper(measured):
    problems = _problems(measured["cascade"])
    assert not problems, "cascade decode launches that do not fit sm_90a (launch_config):\n" + "\n".join(problems)


def test_check_refuses_spills_and_shared_memory_over_the_limit(measured):
    (spills, spill_use), (big, big_use) = measured["controls"]
    assert spill_use.spill_stores > 0 and any("spills registers" in p for p in cc.unfit([spills], [spill_use]))
    assert big_use.shared_bytes > cc.HOPPER_SHARED_BYTES
    assert any("shared memory" in p for p in cc.unfit([big], [big_use]))


def test_shared_memory_read_without_a_full_compile_agrees(measured):
    full = {str(c): u.shared_bytes for c, u in measured["defaults"]}
    fast = {str(c): u.shared_bytes for c, u in measured["shared_only"]}
    assert fast == {name: full[name] for name in fast}
