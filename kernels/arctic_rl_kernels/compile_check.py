"""What a kernel configuration costs a GPU, known without one: each of this package's Triton kernels compiled for
a target (Hopper, `sm_90a`, by default) with Triton's own compiler, and the shared memory, registers and spills
of the result read from the compiler (shared memory) and from `ptxas -v` (registers, spills).

A configuration that needs more shared memory than an SM has fails at its first launch: for the fused kernel's
backward that is the first training step. `unfit` names such configurations ahead of time (the tests check every
default and shipped tuned configuration with it); on a 16-bit path a register spill is refused too: it runs, but
each spilled value goes through local memory in the kernel's inner loop.

Compiling needs no GPU, but it needs Triton's compiler: under the interpreter (`TRITON_INTERPRET=1`, how the parity
tests run without a GPU) the kernels and triton.language's own functions are interpreted ones, so there the
configurations are compiled in fresh Python processes without that variable (`python -m
arctic_rl_kernels.compile_check` reads them as JSON).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

HOPPER_SHARED_BYTES = 227 * 1024
"""Shared memory one thread block may use on an H100/H200 (sm_90): 227 KiB of the SM's 228."""
HOPPER = ("cuda", 90, 32)
"""GPUTarget(backend, arch, warp size) for sm_90a."""

_FOREST = {"forward": "_forward_kernel", "dkdv": "_dkdv_kernel", "dq": "_dq_kernel"}
_CASCADE = {"cascade_partials": "_partials_kernel", "cascade_merge": "_merge_kernel"}


@dataclass(frozen=True)
class Config:
    """One launch configuration of one kernel. `tiles`: the fused kernel's BLOCK_M, BLOCK_N, num_warps, num_stages;
    the cascade kernels' launch constexprs (BLOCK_N, BLOCK_S, ...) and num_warps, num_stages. `groups`: query heads
    per KV head; `paged`: the cascade kernel reads keys through a paged cache's rows."""

    kernel: str
    dtype: str
    head_dim: int
    head_dim_v: int
    tiles: dict
    softcap: bool = False
    window: bool = False
    groups: int = 1
    paged: bool = False

    def __str__(self) -> str:
        mods = "+".join(name for name, on in (("softcap", self.softcap), ("window", self.window)) if on) or "no mods"
        tiles = " ".join(f"{k}={v}" for k, v in self.tiles.items())
        return (f"{self.kernel} {self.dtype} D={self.head_dim} DV={self.head_dim_v} {mods} groups={self.groups}"
                f"{' paged' if self.paged else ''} [{tiles}]")


@dataclass(frozen=True)
class Usage:
    shared_bytes: int
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    """None where not measured (`usage(..., registers=False)`)."""
    error: str | None = None
    """Why it did not compile (then the counts are 0)."""


def forest_configs(dtype: str, head_dim: int, head_dim_v: int | None = None, *, softcap: bool = False,
                   window: bool = False, tiles: dict | None = None, groups: int = 1) -> list[Config]:
    """The fused kernel's three kernels as a CUDA device launches them: with `tiles` ({forward, dkdv, dq}), else
    the default tiles for the head size `tiles_for` asks them for (the larger of D and DV)."""
    import torch

    from arctic_rl_kernels.forest_flash_attention import default_tiles

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tiles = tiles or default_tiles(torch.device("cuda"), getattr(torch, dtype), max(head_dim, head_dim_v))
    return [Config(kernel, dtype, head_dim, head_dim_v, dict(tiles[kernel]), softcap, window, groups)
            for kernel in _FOREST]


def cascade_configs(dtype: str, head_dim: int, head_dim_v: int | None = None, *, groups: int = 4,
                    paged: bool = True) -> list[Config]:
    """Cascade decode's two kernels at their default launch on a GPU (`launch_config`, `default_block_r`)."""
    import torch

    from arctic_rl_kernels.cascade_decode import launch_config

    launch = launch_config(getattr(torch, dtype), head_dim, interpreted=False)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    partials = {"BLOCK_N": launch.block_n, "num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return [Config("cascade_partials", dtype, head_dim, head_dim_v, partials, groups=groups, paged=paged),
            Config("cascade_merge", dtype, head_dim, head_dim_v, {"BLOCK_S": launch.merge_slots}, groups=groups)]


def unfit(configs: list[Config], usages: list[Usage] | None = None,
          shared_limit: int = HOPPER_SHARED_BYTES) -> list[str]:
    """Why each configuration that does not fit does not: it failed to compile, needs more than `shared_limit`
    bytes of shared memory, or spills registers on a 16-bit path. Empty when all fit."""
    usages = usage(configs) if usages is None else usages
    problems = []
    for config, used in zip(configs, usages):
        if used.error:
            problems.append(f"{config}: does not compile: {used.error}")
            continue
        if used.shared_bytes > shared_limit:
            problems.append(f"{config}: needs {used.shared_bytes} bytes of shared memory, over {shared_limit}")
        if config.dtype != "float32" and used.registers is None:
            problems.append(f"{config}: its registers and spills were not measured")
        elif config.dtype != "float32" and (used.spill_stores or used.spill_loads):
            problems.append(f"{config}: spills registers ({used.registers} used; {used.spill_stores} bytes of spill "
                            f"stores, {used.spill_loads} of loads)")
    return problems


def usage(configs: list[Config], target: tuple = HOPPER, jobs: int = 1, registers=True) -> list[Usage]:
    """Each configuration's shared memory, registers and spills compiled for `target`. In this process when its
    kernels are compiled ones and jobs is 1; else in `jobs` fresh processes without the interpreter.
    `registers` (a bool, one per configuration, or a function of a Config): whether to measure registers and
    spills; where not, they are None and the kernel is compiled only as far as Triton's shared-memory allocation
    (fp32's FMA dots take tens of seconds to lower and assemble)."""
    from arctic_rl_kernels.forest_flash_attention import _forward_kernel
    from arctic_rl_kernels.triton_device import interpreted

    if callable(registers):
        wanted = [bool(registers(c)) for c in configs]
    elif isinstance(registers, (list, tuple)):
        wanted = [bool(w) for w in registers]
    else:
        wanted = [bool(registers)] * len(configs)
    if not configs:
        return []
    if jobs <= 1 and not interpreted(_forward_kernel):
        return [_measure(config, target, want) for config, want in zip(configs, wanted)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    chunks = [list(range(len(configs)))[j::jobs] for j in range(max(1, min(jobs, len(configs))))]
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for j, chunk in enumerate(chunks):
            path = os.path.join(tmp, f"{j}.json")
            with open(path, "w") as f:
                json.dump({"target": list(target), "configs": [asdict(configs[i]) for i in chunk],
                           "registers": [wanted[i] for i in chunk]}, f)
            runs.append(subprocess.Popen([sys.executable, "-m", __name__, path], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
        results: list[Usage | None] = [None] * len(configs)
        for j, (chunk, run) in enumerate(zip(chunks, runs)):
            output, _ = run.communicate()
            if run.returncode:
                raise RuntimeError(f"compiling kernel configurations failed (exit {run.returncode}):\n{output[-4000:]}")
            with open(os.path.join(tmp, f"{j}.json")) as f:
                for i, used in zip(chunk, json.load(f)):
                    results[i] = Usage(**used)
    return results


def _signature(kernel: str, fn, config: Config):
    """The argument types and constexprs of a launch of `kernel` (by argument name, as the launch code passes
    them), and the arguments Triton specializes as divisible by 16."""
    import triton
    import triton.language as tl

    elem = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[config.dtype]
    D, DV = config.head_dim, config.head_dim_v
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    tiles = {k: v for k, v in config.tiles.items() if k not in ("num_warps", "num_stages")}
    if kernel in _FOREST:
        pointers = {**dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_OUT"), f"*{elem}"),
                    "LSE": "*fp32", "DELTA": "*fp32", "DQ_ACC": "*fp32", "POS": "*i64"}
        if kernel == "dkdv":
            tiles = {"ATOMIC_DQ": False, **tiles}
        scalars = {"scale": "fp32", "softcap": "fp32", "N": "i32", "window": "i32"}
        constexprs = dict(GROUPS=config.groups, D=D, DV=DV, BLOCK_D=block_d, BLOCK_DV=block_dv,
                          SOFTCAP=config.softcap, WINDOW=config.window,
                          PRECISION="ieee" if config.dtype == "float32" else "tf32", UPCAST=False, **tiles)
    elif kernel == "cascade_partials":
        from arctic_rl_kernels.cascade_decode import ROWS, default_block_r

        block_r = default_block_r(ROWS * config.groups, ROWS)
        pointers = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr"), f"*{elem}"), "out_ptr": "*fp32", "lse_ptr": "*fp32"}
        scalars = {"scale_log2": "fp32", "H": "i32"}
        dot = tl.float32 if config.dtype == "float32" else getattr(tl, config.dtype)
        # A K/V cache's head dimension is contiguous: Triton specializes those strides, equal to 1, as constants.
        constexprs = dict(GROUP=config.groups, BLOCK_R=block_r,
                          BLOCK_M=max(16, triton.next_power_of_2(block_r * config.groups)), BLOCK_D=block_d,
                          BLOCK_DV=block_dv, DOT_DTYPE=dot,
                          PRECISION="ieee" if config.dtype == "float32" else None, PAGED=config.paged,
                          stride_qd=1, stride_kd=1, stride_vd=1, **tiles)
    else:  # cascade_merge
        pointers = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{elem}", "lse_ptr": "*fp32"}
        scalars = {"H": "i32"}
        constexprs = dict(BLOCK_DV=block_dv, **tiles)
    signature, divisible = {}, []
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers or name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")  # plans' and layouts' tables are int32
            divisible.append(i)  # torch's allocations are 16-byte aligned
        elif name in scalars:
            signature[name] = scalars[name]
        elif name.startswith("stride") or name in ("D", "DV"):
            signature[name] = "i32"
            divisible.append(i)  # multiples of a head size (a multiple of 16)
        else:
            raise ValueError(f"{kernel}: no type known for argument {name!r}; compile_check needs updating")
    missing = set(constexprs) - set(fn.arg_names)
    if missing:
        raise ValueError(f"{kernel} takes no {sorted(missing)}; compile_check needs updating")
    return signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()}, divisible


def _measure(config: Config, target: tuple, registers: bool = True) -> Usage:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if config.kernel in _FOREST:
        from arctic_rl_kernels import forest_flash_attention as module
    else:
        from arctic_rl_kernels import cascade_decode as module
    fn = getattr(module, {**_FOREST, **_CASCADE}[config.kernel])
    signature, constexprs, divisible = _signature(config.kernel, fn, config)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    options = {k: config.tiles[k] for k in ("num_warps", "num_stages") if k in config.tiles}
    try:
        if not registers:
            try:
                return Usage(_shared_bytes(source, GPUTarget(*target), options), None, None, None)
            except (AttributeError, ImportError, TypeError):
                pass  # another Triton's internals: compile it whole
        log, before = io.StringIO(), (knobs.nvidia.dump_ptxas_log, knobs.nvidia.disable_ptxas_opt)
        # ptxas -v runs on every compile: dump_ptxas_log prints its report.
        knobs.nvidia.dump_ptxas_log, knobs.nvidia.disable_ptxas_opt = registers, not registers
        try:
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(source, target=GPUTarget(*target), options=options)
        finally:
            knobs.nvidia.dump_ptxas_log, knobs.nvidia.disable_ptxas_opt = before
    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is a result
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return Usage(0, 0, 0, 0, error=f"{type(exc).__name__}: {first}")
    if not registers:
        return Usage(compiled.metadata.shared, None, None, None)
    report = log.getvalue()
    if "registers" not in report:  # from Triton's cache: no ptxas ran
        report = _ptxas_report(compiled.asm["ptx"], target, compiled.metadata)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if not regs or not spills:
        raise RuntimeError(f"{config}: no register report in ptxas's output:\n{report}")
    return Usage(compiled.metadata.shared, int(regs[1]), int(spills[1]), int(spills[2]))


def _shared_bytes(source, target, options) -> int:
    """Shared memory alone, without lowering to LLVM, PTX and SASS (tens of seconds for fp32's FMA dots): Triton's
    stages to TritonGPU IR, then the passes of its LLVM stage up to the shared-memory allocation, which sets the
    `ttg.shared` that compiling records (Triton 3.9's `make_llir`; tests/test_kernel_compile.py checks both agree)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    stages = {}
    backend.add_stages(stages, opts, source.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata = {"target": target, **opts.__dict__}
    for stage in ("ttir", "ttgir"):
        module = stages[stage](module, metadata)
    capability = backend._parse_arch(opts.arch)
    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm, False)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, get_ptx_version_from_options(opts, target.arch))
    pm.run(module, "compile_check.shared")
    return module.get_int_attr("ttg.shared")


def _ptxas_report(ptx: str, target: tuple, metadata) -> str:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        fmad = [] if metadata.enable_fp_fusion else ["--fmad=false"]
        run = subprocess.run([get_ptxas(target[1]).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(target[1])}", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True)
    return run.stdout + run.stderr


def _main(path: str) -> None:
    with open(path) as f:
        request = json.load(f)
    usages = [_measure(Config(**config), tuple(request["target"]), registers)
              for config, registers in zip(request["configs"], request["registers"])]
    with open(path, "w") as f:
        json.dump([asdict(u) for u in usages], f)


if __name__ == "__main__":
    _main(sys.argv[1])
