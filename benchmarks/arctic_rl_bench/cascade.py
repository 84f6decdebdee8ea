"""`arctic-rl bench cascade`: one decoding step's attention (one layer) for G samples of one prompt, with
forest cascade attention (the prompt's K/V read once for the group) and without it (the same kernel on
`DecodeForest.unshared()`: every sample reads the prompt itself), beside the tokens/s that the K/V reads
allow at the device's memory bandwidth.

Each call is timed twice: `graph_s`, the device's time alone (calls captured in a CUDA graph, its replays
timed by CUDA events), which tokens/s and the share of the read bound come from; and `eager_s`, a call from
an idle device, host work included (checks, plan lookup, launches). `--sweep` also times the cascade at
other key chunks and launch settings, to find a better default on the GPU at hand.

It measures on a CUDA GPU only. `--interpret-smoke` runs a tiny shape under the Triton interpreter on
CPU to check the code path (eager only); its timings mean nothing. Measuring needs only torch and Triton:
`python -m arctic_rl_bench.cascade` runs it on a GPU machine with nothing else installed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

SEED = 1234
BANDWIDTH_GBS = {"H200": 4800, "H100 80GB HBM3": 3350, "H100 PCIe": 2000}
"""Memory bandwidth by a substring of the device name (H100 SXM reports itself as "H100 80GB HBM3")."""
SMOKE = {"prompt_len": 40, "group": [2, 3], "suffix_len": 3, "heads": 4, "kv_heads": 2, "head_dim": 16, "repeats": 1,
         "chunk": 16}
GRAPH_CALLS = 10
"""Calls captured in one CUDA graph: a replay keeps the device busy for all of them, so the gap while the host
launches it is a tenth of a call's time or less."""
SWEEP = {"chunk": [256, 512, 1024, 2048], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3, 4]}
"""`--sweep` on a GPU: each combination for the cascade at each G (the kernel's default is one of them)."""
SMOKE_SWEEP = {"chunk": [8, 16], "block_n": [16, 32], "num_warps": [4], "num_stages": [1]}
SWEEP_PARITY = 1e-2
"""A combination whose output differs from the default's by more (relative to its largest value) is not a candidate."""


def known_bandwidth(device_name: str) -> float | None:
    return next((gbs for key, gbs in BANDWIDTH_GBS.items() if key in device_name), None)


def copy_bandwidth_gbs(size_bytes: int = 2**32, repeats: int = 10) -> float:
    """The device's memory bandwidth as a device-to-device copy achieves it (bytes read plus written over the median
    copy's time, by CUDA events): the ceiling a read-bound kernel can reach here, beside the datasheet's figure."""
    import statistics

    import torch

    src = torch.empty(size_bytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return size_bytes / statistics.median(times) / 1e9


def error_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def graph_seconds(fn, repeats: int) -> float:
    """One call's device time: GRAPH_CALLS calls of `fn` captured in a CUDA graph, the median replay / GRAPH_CALLS."""
    import torch

    from arctic_rl_bench.measure import median_seconds

    # Warm up on a side stream before capture, as torch.cuda.graph's documentation asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    seconds, _ = median_seconds(graph.replay, repeats, cuda=True)
    return seconds / GRAPH_CALLS


def time_call(fn, repeats: int, cuda: bool) -> dict:
    """eager_s: median call from an idle device, host work included (on CPU: wall time). graph_s: the device's time
    alone (`graph_seconds`); None on CPU, or where capture fails (graph_error says why). timed_by: which of the
    two the caller's rates use."""
    from arctic_rl_bench.measure import median_seconds

    timed = {"eager_s": median_seconds(fn, repeats, cuda=cuda)[0], "graph_s": None, "timed_by": "eager"}
    if cuda:
        try:
            timed.update(graph_s=graph_seconds(fn, repeats), timed_by="graph")
        except RuntimeError as e:  # torch reports a failed capture as a RuntimeError
            timed["graph_error"] = error_line(e)
    return timed


def timed_seconds(timed: dict) -> float:
    """The time `time_call` says rates come from."""
    return timed["graph_s"] if timed["timed_by"] == "graph" else timed["eager_s"]


def decode_inputs(spec: dict, group: int, device: str):
    """The bench's forest (one prompt, `group` samples) and its q, k_cache, v_cache."""
    import torch

    from arctic_rl_kernels.cascade_decode import DecodeForest

    dtype = getattr(torch, spec["dtype"])
    forest = DecodeForest.groups([spec["prompt_len"]], [[spec["suffix_len"]] * group])
    gen = torch.Generator(device).manual_seed(SEED)
    H, Hkv, D, T = spec["heads"], spec["kv_heads"], spec["head_dim"], forest.num_tokens
    shapes = ((group, H, D), (Hkv, T, D), (Hkv, T, D))
    return (forest, *(torch.randn(shape, generator=gen, device=device).to(dtype) for shape in shapes))


def max_rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def measure(spec: dict, group: int, bandwidth_gbs: float | None, device: str) -> dict:
    from arctic_rl_kernels.cascade_decode import cascade_decode, fill_chunk, kv_read_bytes

    forest, q, k, v = decode_inputs(spec, group, device)
    variants = {"cascade": forest, "unshared": forest.unshared()}
    # The cascade's chunk (given, or the kernel's choice for this forest) for both: the same items per segment.
    chunk = spec["chunk"] or fill_chunk(forest, spec["kv_heads"], spec["block_r"], q.device)
    kwargs = {"scale": spec["head_dim"] ** -0.5, "chunk": chunk, "block_r": spec["block_r"]}
    result, outs = {"group": group, "chunk": chunk}, {}
    for name, f in variants.items():
        outs[name] = cascade_decode(q, k, v, f, **kwargs)  # also the first warm-up: compiles, uploads the plan
        timed = time_call(lambda: cascade_decode(q, k, v, f, **kwargs), spec["repeats"], cuda=device == "cuda")
        read = kv_read_bytes(f, q, k, v, chunk=chunk, block_r=spec["block_r"])
        bound_s = read / (bandwidth_gbs * 1e9) if bandwidth_gbs else None
        result[name] = {**timed, "tokens_per_s": group / timed_seconds(timed), "kv_read_bytes": read,
                        "bound_tokens_per_s": group / bound_s if bound_s else None,
                        "of_bound": bound_s / timed_seconds(timed) if bound_s else None}
    result["speedup"] = timed_seconds(result["unshared"]) / timed_seconds(result["cascade"])
    result["bound_speedup"] = result["unshared"]["kv_read_bytes"] / result["cascade"]["kv_read_bytes"]
    result["parity_max_rel_err"] = max_rel_err(outs["cascade"], outs["unshared"])
    return result


def sweep(spec: dict, group: int, grid: dict, device: str) -> dict:
    """The cascade at each combination of `grid` (chunk, and the partials kernel's block_n, num_warps, num_stages):
    every combination's timings and parity with the default launch, and the fastest whose parity holds."""
    from arctic_rl_kernels.cascade_decode import LaunchConfig, cascade_decode, fill_chunk, launch_config

    forest, q, k, v = decode_inputs(spec, group, device)
    default = launch_config(q.dtype, spec["head_dim"])
    default_chunk = spec["chunk"] or fill_chunk(forest, spec["kv_heads"], spec["block_r"], q.device)
    kwargs = {"scale": spec["head_dim"] ** -0.5, "block_r": spec["block_r"]}
    ref = cascade_decode(q, k, v, forest, chunk=default_chunk, launch=default, **kwargs)
    tried = []
    for chunk, block_n, num_warps, num_stages in itertools.product(*grid.values()):
        entry = {"chunk": chunk, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
        launch = LaunchConfig(block_n, num_warps, num_stages, default.merge_slots)
        call = functools.partial(cascade_decode, q, k, v, forest, chunk=chunk, launch=launch, **kwargs)
        try:
            entry["parity_max_rel_err"] = max_rel_err(call(), ref)  # also compiles this combination
        except Exception as e:  # one the device cannot run (shared memory, registers) is reported, not fatal
            tried.append({**entry, "error": error_line(e)})
            continue
        tried.append({**entry, **time_call(call, spec["repeats"], cuda=device == "cuda")})
    candidates = [t for t in tried if "error" not in t and t["parity_max_rel_err"] <= SWEEP_PARITY]
    default_entry = {"chunk": default_chunk, "block_n": default.block_n, "num_warps": default.num_warps,
                     "num_stages": default.num_stages}
    return {"group": group, "best": min(candidates, key=timed_seconds) if candidates else None,
            "default": next((t for t in tried if all(t[key] == value for key, value in default_entry.items())), None),
            "tried": tried}


def host_plan(spec: dict, groups: int, block_size: int, repeats: int) -> dict:
    """What zorro.inference's vLLM backend does on the host each decoding step (vllm_forest_attention): the forest
    of `groups` prompts x G samples found from their block tables, and the kernel's work plan. No GPU needed."""
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.cascade_decode import DecodeForest, default_block_r, fill_chunk

    P, S = spec["prompt_len"], spec["suffix_len"] + 1  # the token being decoded is in the cache
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # whose multiprocessors fill_chunk counts
    results = []
    for G in spec["group"]:
        tables, lens, next_block = [], [], 0
        for _ in range(groups):
            prompt_blocks = list(range(next_block, next_block + P // block_size))  # full blocks are shared
            next_block += len(prompt_blocks)
            for _ in range(G):
                own = -(-(P + S) // block_size) - len(prompt_blocks)
                tables.append(prompt_blocks + list(range(next_block, next_block + own)))
                next_block += own
                lens.append(P + S)
        width = max(map(len, tables))
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        seq_lens = torch.tensor(lens)
        block_r = spec["block_r"] or default_block_r(spec["heads"], spec["kv_heads"])

        def step():
            forest = DecodeForest.from_block_tables(block_table, seq_lens.tolist(), block_size)  # as vLLM's backend
            return forest.plan(spec["chunk"] or fill_chunk(forest, spec["kv_heads"], block_r, device), block_r)

        seconds, _ = median_seconds(step, repeats)
        results.append({"group": G, "sequences": len(tables), "host_ms": seconds * 1e3})
    return {"benchmark": "cascade host plan", "groups": groups, "block_size": block_size, "shape": spec,
            "results": results}


def launch_line(t: dict) -> str:
    return f"chunk {t['chunk']:<5} block_n {t['block_n']:<4} warps {t['num_warps']} stages {t['num_stages']}"


def add_arguments(p) -> None:
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--group", type=int, nargs="+", default=[8, 16], help="samples per prompt (G); several to compare")
    p.add_argument("--suffix-len", type=int, default=512, help="tokens each sample has generated so far")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--chunk", type=int, default=None, help="keys per work item (default: the kernel's choice per forest)")
    p.add_argument("--block-r", type=int, default=None, help="sequences per work item (default: the kernel's)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help=f"device memory bandwidth in GB/s for the read bound (known: {BANDWIDTH_GBS})")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="a tiny shape under the Triton interpreter on CPU, to check the code path (timings mean nothing)")
    p.add_argument("--host-plan", type=int, default=None, metavar="GROUPS",
                   help="time instead what zorro.inference's vLLM backend computes on the host per decoding step for "
                        "GROUPS prompts x G samples (block tables to forest and work plan); no GPU needed")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size for --host-plan")
    p.add_argument("--sweep", action="store_true",
                   help="also time the cascade at each G over key chunks and the partials kernel's launch settings "
                        f"{SWEEP} and report the fastest (with --interpret-smoke: a tiny grid, to check the code path)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import torch

    spec = {k: getattr(args, k) for k in ("prompt_len", "group", "suffix_len", "heads", "kv_heads", "head_dim", "dtype",
                                           "repeats", "chunk", "block_r")}
    if args.host_plan is not None:
        if args.sweep:
            raise SystemExit("--sweep times the kernel on a GPU; --host-plan times host work only")
        if args.host_plan < 1 or args.block_size < 1:
            raise SystemExit("--host-plan and --block-size must be >= 1")
        result = host_plan(spec, args.host_plan, args.block_size, min(spec["repeats"], 5))
        if args.json:
            print(json.dumps(result))
        else:
            for r in result["results"]:
                print(f"{args.host_plan} prompts x G={r['group']} ({r['sequences']} sequences), prompt {spec['prompt_len']}, "
                      f"suffix {spec['suffix_len']}, block size {args.block_size}: {r['host_ms']:.1f} ms per decoding step "
                      f"on the host (median)")
        return 0
    if args.interpret_smoke:
        from arctic_rl_core.patches import environment_default

        spec.update(SMOKE)
        # Triton picks interpreted or compiled functions as it decorates them: before it is first imported.
        environment_default("TRITON_INTERPRET", "1", "Triton: --interpret-smoke runs the kernel on CPU", __name__)
    elif not torch.cuda.is_available():
        raise SystemExit("bench cascade measures on a CUDA GPU only; --interpret-smoke runs a tiny shape under the "
                         "Triton interpreter on CPU to check the code path (its timings mean nothing)")
    from arctic_rl_kernels import cascade_decode as cd

    if args.interpret_smoke and not cd.INTERPRETED:
        raise SystemExit("--interpret-smoke: triton was imported before TRITON_INTERPRET=1 could be set (or it is "
                         "set to something else); run with TRITON_INTERPRET=1 in the environment")
    positive = {k: spec[k] for k in ("prompt_len", "heads", "kv_heads", "head_dim", "repeats", "chunk", "block_r")}
    for name, value in {**positive, "group": min(spec["group"])}.items():
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if spec["suffix_len"] < 0 or spec["heads"] % spec["kv_heads"]:
        raise SystemExit("--suffix-len must be >= 0 and --heads a multiple of --kv-heads")
    if spec["block_r"] is None:
        spec["block_r"] = cd.default_block_r(spec["heads"], spec["kv_heads"])
    device = "cpu" if args.interpret_smoke else "cuda"
    name = (f"Triton interpreter on CPU x{torch.get_num_threads()} threads" if args.interpret_smoke
            else torch.cuda.get_device_name(0))
    bandwidth = args.bandwidth_gbs or (None if args.interpret_smoke else known_bandwidth(name))
    if bandwidth is None and not args.interpret_smoke:
        raise SystemExit(f"--bandwidth-gbs is required on {name}: the read bound needs the device's memory bandwidth")
    results = [measure(spec, g, bandwidth, device) for g in spec["group"]]
    eager_only = [f"G={r['group']} {v}: {r[v]['graph_error']}" for r in results for v in ("cascade", "unshared")
                  if "graph_error" in r[v]]
    notes = (["interpreter smoke run: the timings mean nothing"] if args.interpret_smoke else []) + (
        [f"CUDA graph capture failed ({'; '.join(eager_only)}): those rates come from eager times, host work included"]
        if eager_only else [])
    result = {
        "benchmark": "cascade",
        "device": name,
        "note": "; ".join(notes) or None,
        "shape": spec,
        "bandwidth_gbs": bandwidth,
        "copy_gbs": None if args.interpret_smoke else copy_bandwidth_gbs(),
        "results": results,
    }
    if args.sweep:
        result["sweep"] = [sweep(spec, g, SMOKE_SWEEP if args.interpret_smoke else SWEEP, device) for g in spec["group"]]
    if args.json:
        print(json.dumps(result))
        return 0
    if result["note"]:
        print(result["note"])
    print(f"{name}: prompt {spec['prompt_len']}, suffix {spec['suffix_len']}, heads {spec['heads']}/{spec['kv_heads']}, "
          f"head dim {spec['head_dim']}, {spec['dtype']}, one layer's decode-step attention (median of {spec['repeats']}); "
          f"graph: device time (CUDA graph replays), eager: one call from an idle device, host work included")
    if result["copy_gbs"]:
        print(f"read bound at {bandwidth:.0f} GB/s; a device-to-device copy here moves {result['copy_gbs']:.0f} GB/s")
    for r in results:
        for variant in ("cascade", "unshared"):
            x = r[variant]
            graph = f"{x['graph_s'] * 1e6:9.1f}" if x["graph_s"] is not None else "      n/a"
            bound = (f"read bound {x['bound_tokens_per_s']:.0f} tokens/s ({x['of_bound']:.0%} of it)"
                     if x["bound_tokens_per_s"] else "read bound n/a")
            print(f"G={r['group']:<3} {variant:<8} graph {graph} us  eager {x['eager_s'] * 1e6:9.1f} us  "
                  f"{x['tokens_per_s']:12.0f} tokens/s ({x['timed_by']})  KV read {x['kv_read_bytes'] / 2**20:8.1f} MiB  "
                  f"{bound}")
        print(f"G={r['group']:<3} chunk {r['chunk']}: speedup {r['speedup']:.2f}x (read bound {r['bound_speedup']:.2f}x), "
              f"parity max rel err {r['parity_max_rel_err']:.1e}")
    for s in result.get("sweep", []):
        for t in s["tried"]:
            if "error" in t:
                print(f"G={s['group']:<3} sweep {launch_line(t)}: {t['error']}")
        for label, missing in (("default", "not in the grid, or it failed"), ("best", "no combination ran")):
            t = s[label]
            print(f"G={s['group']:<3} sweep {label:<7} " + (
                f"{launch_line(t)}: {timed_seconds(t) * 1e6:9.1f} us ({t['timed_by']}), parity {t['parity_max_rel_err']:.1e}"
                if t and "error" not in t else missing))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m arctic_rl_bench.cascade", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
