"""`arctic-rl bench attention`: every split-attention backend that runs on this device, side by side on one
forest of GRPO groups (one layer's attention: forward alone, as in log_probs, and forward+backward, as in
fwd_bwd), each output checked against the `math` primitives. `--sweep` measures several prompt lengths (the
responses an eighth as long) in one run; `--save` records the timings for this device model, dtype, head size
and length (`arctic_rl_kernels/timings/`), where `zorro.attention_backend: auto` reads them. `--tune` instead
times the fused Triton kernel's tile configurations, kernel by kernel, and `--save` records the fastest.

It needs only torch (and Triton for `triton`): `python -m arctic_rl_bench.attention` runs it where the rest
of Arctic RL is not installed, such as a GPU machine with nothing but PyTorch. Triton runs compiled only:
under its interpreter its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

SEED = 1234
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
"""Largest output difference from the math primitives (relative to the largest output) a backend may show to
be recorded: fp32 kernels summing in another order, 16-bit ones rounding P before P@V."""
TILE_CANDIDATES = {
    # (BLOCK_M queries, BLOCK_N keys, warps, stages). The forward and dQ walk keys for a query tile, so large
    # query tiles amortise each K/V load; dK/dV walk queries for a key tile, so there the key tile is large
    # (FlashAttention-2's backward and Triton's fused-attention tutorial take the same shapes). dK/dV's with a
    # fifth entry, True, add dQ by atomics in the same pass (ATOMIC_DQ): the backward then runs no dQ kernel.
    "forward": [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (128, 64, 8, 4),
                (64, 128, 4, 3), (128, 128, 8, 2)],
    "dq": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 4, 5), (64, 32, 4, 3), (128, 64, 4, 3),
           (128, 128, 8, 2), (128, 64, 8, 4)],
    "dkdv": [(64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3),
             (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3, True), (32, 64, 4, 3, True), (64, 64, 8, 3, True),
             (32, 128, 8, 3, True), (64, 128, 8, 2, True), (32, 64, 8, 3, True), (16, 128, 4, 3, True)],
}
"""What `--tune` tries for each of the fused kernel's kernels, in this order (16-bit inputs; fp32 is never auto's
choice for it on CUDA)."""
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "ATOMIC_DQ")


def backends_here(device) -> list[str]:
    from arctic_rl_kernels.split_attention import BACKENDS, unusable

    return [name for name in BACKENDS if unusable(name, device, compiled=True) is None]


def _inputs(spec: dict, dtype_name: str, device):
    import torch

    from arctic_rl_kernels.layout import ForestLayout

    layout = ForestLayout.groups([spec["prompt"]] * spec["groups"], [[spec["response"]] * spec["group"]] * spec["groups"])
    gen = torch.Generator(device).manual_seed(SEED)
    dtype, H, Hkv, D, N = getattr(torch, dtype_name), spec["heads"], spec["kv_heads"], spec["head_dim"], layout.num_tokens
    q, k, v = (torch.randn(h, N, D, generator=gen, device=device).to(dtype).requires_grad_() for h in (H, Hkv, Hkv))
    dout = torch.randn(H, N, D, generator=gen, device=device).to(dtype)
    return layout, q, k, v, dout


def measure(spec: dict, dtype_name: str, backends: list[str], device) -> dict:
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.split_attention import split_attention

    layout, q, k, v, dout = _inputs(spec, dtype_name, device)
    scale, cuda = spec["head_dim"] ** -0.5, device.type == "cuda"

    def forward(name):
        with torch.no_grad():
            return split_attention(q, k, v, layout, scale, name)

    def forward_backward(name):
        q.grad = k.grad = v.grad = None
        split_attention(q, k, v, layout, scale, name).backward(dout)

    reference = forward("math").float()
    results = {}
    for name in backends:
        out = forward(name).float()  # also compiles
        fwd_s, _ = median_seconds(lambda: forward(name), spec["repeats"], cuda=cuda)
        fwd_bwd_s, _ = median_seconds(lambda: forward_backward(name), spec["repeats"], cuda=cuda)
        results[name] = {"fwd_ms": fwd_s * 1e3, "fwd_bwd_ms": fwd_bwd_s * 1e3,
                         "max_rel_err": float((out - reference).abs().max() / reference.abs().max())}
    return results


def tune(spec: dict, dtype_name: str, device) -> dict:
    """The fused kernel's fastest tiles, kernel by kernel at this shape: the forward timed alone; the backward
    timed whole with one of its kernels' tiles varied (dQ first, then dK/dV with dQ's best, where the one-pass
    candidates, dQ by atomics, run against the two-pass ones). A configuration
    that fails to compile or launch (too much shared memory, too many registers) or whose results differ from
    the default tiles' by more than the dtype's tolerance is dropped, with the reason."""
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.forest_flash_attention import default_tiles, forest_attention_backward, forest_attention_forward
    from arctic_rl_kernels.split_attention import NO_MODS

    layout, q, k, v, dout = _inputs(spec, dtype_name, device)
    q, k, v = q.detach(), k.detach(), v.detach()
    scale, cuda = spec["head_dim"] ** -0.5, device.type == "cuda"
    best = default_tiles(device, q.dtype, spec["head_dim"])

    def forward(tiles):
        return forest_attention_forward(q, k, v, layout, scale, NO_MODS, None, tiles)

    out, lse = forward(best)
    reference = {"forward": (out.float(),)}
    reference["dq"] = reference["dkdv"] = tuple(g.float() for g in forest_attention_backward(
        dout, q, k, v, out, lse, layout, scale, NO_MODS, None, best))

    def backward(tiles):
        return forest_attention_backward(dout, q, k, v, out, lse, layout, scale, NO_MODS, None, tiles)

    trials = {}
    for kernel, run in (("forward", forward), ("dq", backward), ("dkdv", backward)):
        rows = []
        default = tuple(best[kernel].get(key, False) for key in TILE_KEYS)
        candidates = [(*c, False)[:5] if kernel == "dkdv" else c for c in TILE_CANDIDATES[kernel]]
        for candidate in dict.fromkeys([default[:len(candidates[0])], *candidates]):  # the default timed too
            tile = dict(zip(TILE_KEYS, candidate))
            tiles = {**best, kernel: tile}
            try:
                got = run(tiles)
                got = (got[0],) if kernel == "forward" else got
                err = max(float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, reference[kernel]))
                if not err <= TOLERANCE[dtype_name]:
                    rows.append({**tile, "error": f"differs from the default tiles by {err:.1e}"})
                    continue
                seconds, _ = median_seconds(lambda: run(tiles), spec["repeats"], cuda=cuda)
            except Exception as exc:  # noqa: BLE001 - a configuration this device cannot run is a result, not a failure
                rows.append({**tile, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            rows.append({**tile, "ms": seconds * 1e3, "max_rel_err": err})
        timed = [r for r in rows if "ms" in r]
        if timed:
            fastest = min(timed, key=lambda r: r["ms"])
            best = {**best, kernel: {key: fastest[key] for key in TILE_KEYS if key in fastest}}
        trials[kernel] = rows
    return {"tiles": best, "trials": trials}


def add_arguments(p) -> None:
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens per group (P)")
    p.add_argument("--response", type=int, default=256, help="tokens per response (R)")
    p.add_argument("--sweep", type=int, nargs="+", default=None, metavar="P",
                   help="measure at each of these prompt lengths, the responses an eighth as long (instead of --prompt "
                        "and --response)")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads (Qwen3-0.6B: 16)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", nargs="+", choices=sorted(TOLERANCE), default=None,
                   help="default: float32 on CPU; bfloat16, float16 and float32 on CUDA (--tune: bfloat16)")
    p.add_argument("--backends", nargs="+", default=None, help="default: every backend that runs here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tune", action="store_true",
                   help="time the fused Triton kernel's tile configurations instead (CUDA only); --save records the fastest")
    p.add_argument("--save", action="store_true", help="record the timings (or --tune's tiles) for this device model")
    p.add_argument("--json", action="store_true")


def _context(device) -> dict:
    import torch

    from arctic_rl_kernels import backend_timings

    return {
        "device": backend_timings.device_name(device) + ("" if device.type == "cuda" else f" x{torch.get_num_threads()} threads"),
        "date": datetime.date.today().isoformat(),
        # The same arguments either way in: through the CLI or as `python -m arctic_rl_bench.attention`.
        "command": " ".join(["arctic-rl bench attention", *sys.argv[3 if sys.argv[1:3] == ["bench", "attention"] else 1:]]),
        "versions": {"torch": torch.__version__, "triton": _version("triton")},
    }


def main(args) -> int:
    import torch

    from arctic_rl_kernels import backend_timings
    from arctic_rl_kernels.split_attention import unusable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = {k: getattr(args, k) for k in ("prompt", "response", "group", "groups", "heads", "kv_heads", "head_dim",
                                           "repeats")}
    if min(spec.values()) < 1 or spec["heads"] % spec["kv_heads"] or min(args.sweep or [8]) < 8:
        raise SystemExit("every size must be >= 1, --sweep lengths >= 8 and --heads a multiple of --kv-heads")
    if args.tune:
        return _tune_main(args, spec, device)
    backends = args.backends or backends_here(device)
    for name in backends:
        reason = unusable(name, device, compiled=True)
        if reason is not None:
            raise SystemExit(f"--backends {name}: {reason}")
    dtypes = args.dtype or (["bfloat16", "float16", "float32"] if device.type == "cuda" else ["float32"])
    shapes = [{**spec, "prompt": p, "response": p // 8} for p in args.sweep] if args.sweep else [spec]
    context = _context(device)
    measurements = [{**context, "dtype": dtype, "head_dim": shape["head_dim"], "longest": shape["prompt"] + shape["response"],
                     "shape": shape, "backends": measure(shape, dtype, backends, device)}
                    for shape in shapes for dtype in dtypes]
    wrong = [f"{backend} ({m['dtype']}, {m['longest']} tokens: {r['max_rel_err']:.1e})" for m in measurements
             for backend, r in m["backends"].items() if r["max_rel_err"] > TOLERANCE[m["dtype"]]]
    if args.json:
        print(json.dumps({"benchmark": "attention", **context, "measurements": measurements}))
    else:
        print(f"{context['device']}: G={spec['group']} x{spec['groups']}, heads {spec['heads']}/{spec['kv_heads']}, "
              f"head dim {spec['head_dim']}, one layer, median of {spec['repeats']}")
        for m in measurements:
            shape = m["shape"]
            for backend, r in sorted(m["backends"].items(), key=lambda item: item[1]["fwd_bwd_ms"]):
                print(f"P={shape['prompt']:<6} R={shape['response']:<5} {m['dtype']:<9} {backend:<10} fwd {r['fwd_ms']:9.2f} ms  "
                      f"fwd+bwd {r['fwd_bwd_ms']:9.2f} ms  max rel err vs math {r['max_rel_err']:.1e}")
    if wrong:
        print(f"outside the tolerance {TOLERANCE}: {', '.join(wrong)}; nothing saved", file=sys.stderr)
        return 1
    if args.save:
        print(f"saved {backend_timings.save_measurements(device, measurements)}", file=sys.stderr)
    return 0


def _tune_main(args, spec: dict, device) -> int:
    import torch

    from arctic_rl_kernels import backend_timings
    from arctic_rl_kernels.split_attention import unusable

    if device.type != "cuda" or unusable("triton", device, compiled=True):
        raise SystemExit("--tune times the compiled Triton kernel: it needs a CUDA device and Triton")
    context = _context(device)
    results = {dtype: tune(spec, dtype, device) for dtype in (args.dtype or ["bfloat16"])}
    if args.json:
        print(json.dumps({"benchmark": "attention tiles", **context, "shape": spec, "dtypes": results}))
    else:
        for dtype, result in results.items():
            for kernel, rows in result["trials"].items():
                for r in rows:
                    tile = f"{r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}"
                    print(f"{dtype:<9} {kernel:<7} {tile:<16} " + (f"{r['ms']:8.2f} ms" if "ms" in r else r["error"]))
            print(f"{dtype}: fastest {result['tiles']}")
    if args.save:
        for dtype, result in results.items():
            entry = {**result["tiles"], **context, "shape": spec}
            path = backend_timings.save_tiles(device, getattr(torch, dtype), spec["head_dim"], entry)
        print(f"saved {path}", file=sys.stderr)
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m arctic_rl_bench.attention", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
