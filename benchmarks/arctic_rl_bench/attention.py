"""`arctic-rl bench attention`: every split-attention backend that runs on this device, side by side on one
forest of GRPO groups (one layer's attention: forward alone, as in log_probs, and forward+backward, as in
fwd_bwd), each output checked against the `math` primitives. `--save` records the timings for this device
model (`arctic_rl_kernels/timings/`), where `zorro.attention_backend: auto` reads them.

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


def backends_here(device) -> list[str]:
    from arctic_rl_kernels.split_attention import BACKENDS, unusable

    return [name for name in BACKENDS if unusable(name, device, compiled=True) is None]


def measure(spec: dict, dtype_name: str, backends: list[str], device) -> dict:
    import torch

    from arctic_rl_bench.measure import median_seconds
    from arctic_rl_kernels.layout import ForestLayout
    from arctic_rl_kernels.split_attention import split_attention

    layout = ForestLayout.groups([spec["prompt"]] * spec["groups"], [[spec["response"]] * spec["group"]] * spec["groups"])
    gen = torch.Generator(device).manual_seed(SEED)
    dtype, H, Hkv, D, N = getattr(torch, dtype_name), spec["heads"], spec["kv_heads"], spec["head_dim"], layout.num_tokens
    q, k, v = (torch.randn(h, N, D, generator=gen, device=device).to(dtype).requires_grad_() for h in (H, Hkv, Hkv))
    dout = torch.randn(H, N, D, generator=gen, device=device).to(dtype)
    scale, cuda = D**-0.5, device.type == "cuda"

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


def add_arguments(p) -> None:
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens per group (P)")
    p.add_argument("--response", type=int, default=256, help="tokens per response (R)")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads (Qwen3-0.6B: 16)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", nargs="+", choices=sorted(TOLERANCE), default=None,
                   help="default: float32 on CPU; bfloat16, float16 and float32 on CUDA")
    p.add_argument("--backends", nargs="+", default=None, help="default: every backend that runs here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--save", action="store_true", help="record the timings for this device model, for `auto`")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    import torch

    from arctic_rl_kernels import backend_timings
    from arctic_rl_kernels.split_attention import unusable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = {k: getattr(args, k) for k in ("prompt", "response", "group", "groups", "heads", "kv_heads", "head_dim",
                                           "repeats")}
    if min(spec.values()) < 1 or spec["heads"] % spec["kv_heads"]:
        raise SystemExit("every size must be >= 1 and --heads a multiple of --kv-heads")
    backends = args.backends or backends_here(device)
    for name in backends:
        reason = unusable(name, device, compiled=True)
        if reason is not None:
            raise SystemExit(f"--backends {name}: {reason}")
    dtypes = args.dtype or (["bfloat16", "float16", "float32"] if device.type == "cuda" else ["float32"])
    record = {
        "benchmark": "attention",
        "device": backend_timings.device_name(device) + ("" if device.type == "cuda" else f" x{torch.get_num_threads()} threads"),
        "date": datetime.date.today().isoformat(),
        # The same arguments either way in: through the CLI or as `python -m arctic_rl_bench.attention`.
        "command": " ".join(["arctic-rl bench attention", *sys.argv[3 if sys.argv[1:3] == ["bench", "attention"] else 1:]]),
        "versions": {"torch": torch.__version__, "triton": _version("triton")},
        "shape": spec,
        "dtypes": {name: measure(spec, name, backends, device) for name in dtypes},
    }
    wrong = [f"{backend} ({dtype}: {r['max_rel_err']:.1e})" for dtype, rows in record["dtypes"].items()
             for backend, r in rows.items() if r["max_rel_err"] > TOLERANCE[dtype]]
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{record['device']}: P={spec['prompt']} R={spec['response']} G={spec['group']} x{spec['groups']}, heads "
              f"{spec['heads']}/{spec['kv_heads']}, head dim {spec['head_dim']}, one layer, median of {spec['repeats']}")
        for dtype, rows in record["dtypes"].items():
            for backend, r in sorted(rows.items(), key=lambda item: item[1]["fwd_bwd_ms"]):
                print(f"{dtype:<9} {backend:<10} fwd {r['fwd_ms']:9.2f} ms  fwd+bwd {r['fwd_bwd_ms']:9.2f} ms  "
                      f"max rel err vs math {r['max_rel_err']:.1e}")
    if wrong:
        print(f"outside the tolerance {TOLERANCE}: {', '.join(wrong)}; nothing saved", file=sys.stderr)
        return 1
    if args.save:
        print(f"saved {backend_timings.save(device, record)}", file=sys.stderr)
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
