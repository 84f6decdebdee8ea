"""`arctic-rl bench cascade`: one decoding step's attention (one layer) for G samples of one prompt, with
forest cascade attention (the prompt's K/V read once for the group) and without it (the same kernel on
`DecodeForest.unshared()`: every sample reads the prompt itself), beside the tokens/s that the K/V reads
allow at the device's memory bandwidth.

It measures on a CUDA GPU only. `--interpret-smoke` runs a tiny shape under the Triton interpreter on
CPU to check the code path; its timings mean nothing. Measuring needs only torch and Triton: `python -m
arctic_rl_bench.cascade` runs it on a GPU machine with nothing else installed.
"""

from __future__ import annotations

import argparse
import json
import sys

SEED = 1234
BANDWIDTH_GBS = {"H200": 4800, "H100 80GB HBM3": 3350, "H100 PCIe": 2000}
"""Memory bandwidth by a substring of the device name (H100 SXM reports itself as "H100 80GB HBM3")."""
SMOKE = {"prompt_len": 40, "group": [2, 3], "suffix_len": 3, "heads": 4, "kv_heads": 2, "head_dim": 16, "repeats": 1,
         "chunk": 16}


def known_bandwidth(device_name: str) -> float | None:
    return next((gbs for key, gbs in BANDWIDTH_GBS.items() if key in device_name), None)


def measure(spec: dict, group: int, bandwidth_gbs: float | None, device: str) -> dict:
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.cascade_decode import DecodeForest, cascade_decode, kv_read_bytes

    dtype = getattr(torch, spec["dtype"])
    forest = DecodeForest.groups([spec["prompt_len"]], [[spec["suffix_len"]] * group])
    variants = {"cascade": forest, "unshared": forest.unshared()}
    gen = torch.Generator(device).manual_seed(SEED)
    H, Hkv, D, T = spec["heads"], spec["kv_heads"], spec["head_dim"], forest.num_tokens
    shapes = ((group, H, D), (Hkv, T, D), (Hkv, T, D))
    q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype) for shape in shapes)
    kwargs = {"scale": D**-0.5, "chunk": spec["chunk"], "block_r": spec["block_r"]}
    result, outs = {"group": group}, {}
    for name, f in variants.items():
        outs[name] = cascade_decode(q, k, v, f, **kwargs).float()  # also the first warm-up: compiles, uploads the plan
        seconds, _ = median_seconds(lambda: cascade_decode(q, k, v, f, **kwargs), spec["repeats"], cuda=device == "cuda")
        read = kv_read_bytes(f, q, k, v, chunk=spec["chunk"], block_r=spec["block_r"])
        bound_s = read / (bandwidth_gbs * 1e9) if bandwidth_gbs else None
        result[name] = {"s": seconds, "tokens_per_s": group / seconds, "kv_read_bytes": read,
                        "bound_tokens_per_s": group / bound_s if bound_s else None}
    result["speedup"] = result["unshared"]["s"] / result["cascade"]["s"]
    result["bound_speedup"] = result["unshared"]["kv_read_bytes"] / result["cascade"]["kv_read_bytes"]
    ref = outs["unshared"]
    result["parity_max_rel_err"] = float((outs["cascade"] - ref).abs().max() / ref.abs().max())
    return result


def host_plan(spec: dict, groups: int, block_size: int, repeats: int) -> dict:
    """What zorro.inference's vLLM backend does on the host each decoding step (vllm_forest_attention): the forest
    of `groups` prompts x G samples found from their block tables, and the kernel's work plan. No GPU needed."""
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.cascade_decode import CHUNK, DecodeForest, default_block_r

    P, S = spec["prompt_len"], spec["suffix_len"] + 1  # the token being decoded is in the cache
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
            forest = DecodeForest.from_block_tables(block_table.tolist(), seq_lens.tolist(), block_size)
            return forest.plan(spec["chunk"] or CHUNK, block_r)

        seconds, _ = median_seconds(step, repeats)
        results.append({"group": G, "sequences": len(tables), "host_ms": seconds * 1e3})
    return {"benchmark": "cascade host plan", "groups": groups, "block_size": block_size, "shape": spec,
            "results": results}


def add_arguments(p) -> None:
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--group", type=int, nargs="+", default=[8, 16], help="samples per prompt (G); several to compare")
    p.add_argument("--suffix-len", type=int, default=512, help="tokens each sample has generated so far")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--chunk", type=int, default=None, help="keys per work item (default: the kernel's)")
    p.add_argument("--block-r", type=int, default=None, help="sequences per work item (default: the kernel's)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help=f"device memory bandwidth in GB/s for the read bound (known: {BANDWIDTH_GBS})")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="a tiny shape under the Triton interpreter on CPU, to check the code path (timings mean nothing)")
    p.add_argument("--host-plan", type=int, default=None, metavar="GROUPS",
                   help="time instead what zorro.inference's vLLM backend computes on the host per decoding step for "
                        "GROUPS prompts x G samples (block tables to forest and work plan); no GPU needed")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size for --host-plan")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import torch

    spec = {k: getattr(args, k) for k in ("prompt_len", "group", "suffix_len", "heads", "kv_heads", "head_dim", "dtype",
                                           "repeats", "chunk", "block_r")}
    if args.host_plan is not None:
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
    if spec["chunk"] is None:
        spec["chunk"] = cd.CHUNK
    if spec["block_r"] is None:
        spec["block_r"] = cd.default_block_r(spec["heads"], spec["kv_heads"])
    device = "cpu" if args.interpret_smoke else "cuda"
    name = (f"Triton interpreter on CPU x{torch.get_num_threads()} threads" if args.interpret_smoke
            else torch.cuda.get_device_name(0))
    bandwidth = args.bandwidth_gbs or (None if args.interpret_smoke else known_bandwidth(name))
    if bandwidth is None and not args.interpret_smoke:
        raise SystemExit(f"--bandwidth-gbs is required on {name}: the read bound needs the device's memory bandwidth")
    result = {
        "benchmark": "cascade",
        "device": name,
        "note": "interpreter smoke run: the timings mean nothing" if args.interpret_smoke else None,
        "shape": spec,
        "bandwidth_gbs": bandwidth,
        "results": [measure(spec, g, bandwidth, device) for g in spec["group"]],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    if result["note"]:
        print(result["note"])
    print(f"{name}: prompt {spec['prompt_len']}, suffix {spec['suffix_len']}, heads {spec['heads']}/{spec['kv_heads']}, "
          f"head dim {spec['head_dim']}, {spec['dtype']}, one layer's decode-step attention (median of {spec['repeats']})")
    for r in result["results"]:
        for variant in ("cascade", "unshared"):
            x = r[variant]
            bound = f"{x['bound_tokens_per_s']:.0f}" if x["bound_tokens_per_s"] else "n/a"
            print(f"G={r['group']:<3} {variant:<8} {x['s'] * 1e6:9.1f} us  {x['tokens_per_s']:12.0f} tokens/s  "
                  f"KV read {x['kv_read_bytes'] / 2**20:8.1f} MiB  read bound {bound} tokens/s")
        print(f"G={r['group']:<3} speedup {r['speedup']:.2f}x (read bound {r['bound_speedup']:.2f}x), "
              f"parity max rel err {r['parity_max_rel_err']:.1e}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m arctic_rl_bench.cascade", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
