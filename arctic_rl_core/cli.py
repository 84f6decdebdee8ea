"""The `arctic-rl` command line."""

from __future__ import annotations

import argparse
import json
import sys

from arctic_rl_core.models.tiny import FAMILIES


def _cmd_plugins(args) -> int:
    from arctic_rl_plugins.manager import get_plugin_manager

    report = get_plugin_manager().report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for p in report["plugins"]:
            print(f"{p['kind']:<15} {p['name']:<22} {p['plugin']} ({p['distribution']} {p['version']})")
        for f in report["failures"]:
            print(f"BROKEN          {f['plugin']:<22} ({f['distribution']}) at {f['stage']}: {f['error']}")
    return 1 if report["failures"] and args.strict else 0


def _cmd_doctor(args) -> int:
    from arctic_rl_core.doctor import diagnose

    report = diagnose()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"python {report['python']} on {report['platform']}")
    for name, version in report["packages"].items():
        print(f"  {name:<14} {version or 'not installed'}")
    print(f"devices: {json.dumps(report['devices'])}")
    for name, state in report["components"].items():
        print(f"  {name:<22} {state}")
    print(f"engines: {', '.join(report['engines'])}; samplers: {', '.join(report['samplers'])}; "
          f"plugin failures: {report['plugin_failures']}")
    return 0


def _cmd_make_tiny_model(args) -> int:
    from arctic_rl_core.models.tiny import make_tiny_model

    path = make_tiny_model(args.family, args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=args.kv_heads, vocab_size=args.vocab_size, max_positions=args.max_positions,
                           seed=args.seed)
    print(path)
    return 0


def _cmd_demo(args) -> int:
    from arctic_rl_core.demo import main

    return main(args)


def _cmd_bench_zorro(args) -> int:
    from arctic_rl_core.bench.zorro import main

    return main(args)


def _cmd_bench_server(args) -> int:
    from arctic_rl_core.bench.server import main

    return main(args)


def _cmd_bench_sync(args) -> int:
    from arctic_rl_core.bench.sync import main

    return main(args)


def _cmd_train(args) -> int:
    from arctic_rl_core.recipes.run import main

    return main(args)


def _cmd_bench_e2e(args) -> int:
    from arctic_rl_core.bench.e2e import main

    return main(args)


def _cmd_serve(args) -> int:
    from arctic_rl_core.server.run import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arctic-rl", description="Arctic RL: a unified backend for RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list discovered plugins and broken ones")
    p.add_argument("--json", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 if any plugin is broken")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("doctor", help="which engines, samplers and devices are usable here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("make-tiny-model", help="build a tiny random model of a real family with a local tokenizer")
    p.add_argument("dir")
    p.add_argument("--family", choices=list(FAMILIES), default="qwen3")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("demo", help="the tiny text2sql GRPO recipe end to end, then its ZoRRo and pipelining speed ratios")
    p.add_argument("--recipe", default="text2sql_tiny", help="recipe file or bundled name")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--rounds", type=int, default=2, help="speed measurement: rounds over the four variants")
    p.add_argument("--steps", type=int, default=3, help="speed measurement: steps per variant per round")
    p.add_argument("overrides", nargs="*", help="recipe overrides, key.path=value")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="run a GRPO recipe: arctic-rl train RECIPE.yaml [key.path=value ...]")
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="VeRL-style overrides, e.g. grpo.steps=50 backend.url=http://host:7000")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("serve", help="serve the training API over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=7000)
    p.add_argument("--config", help="YAML backend config: the job to load at start (else POST /v1/initialize)")
    p.add_argument("--token", help="bearer token required on every request (or $ARCTIC_RL_TOKEN)")
    p.add_argument("--max-request-mb", type=int, default=1024, help="request body cap")
    p.add_argument("--checkpoint-dir", default="checkpoints",
                   help="every checkpoint path a request names must resolve inside this directory (default ./checkpoints)")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                   help="a per-request work cap (docs/server.md lists them), e.g. --limit samples_per_prompt=64")
    p.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks (results belong in docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    p = bench_sub.add_parser("zorro", help="fwd_bwd and log_probs with ZoRRo off vs on")
    from arctic_rl_core.bench.zorro import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_bench_zorro)
    p = bench_sub.add_parser("server", help="HTTP round-trip latency and payload throughput over loopback")
    from arctic_rl_core.bench import server as bench_server

    bench_server.add_arguments(p)
    p.set_defaults(func=_cmd_bench_server)
    p = bench_sub.add_parser("sync", help="sync_weights time and GB/s per path and model size, beside memcpy")
    from arctic_rl_core.bench import sync as bench_sync

    bench_sync.add_arguments(p)
    p.set_defaults(func=_cmd_bench_sync)
    p = bench_sub.add_parser("e2e", help="seconds per GRPO step of the tiny text2sql recipe: naive+sync vs ZoRRo+async")
    from arctic_rl_core.bench import e2e as bench_e2e

    bench_e2e.add_arguments(p)
    p.set_defaults(func=_cmd_bench_e2e)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "plugins":  # plugins must stay light: no torch import
        from arctic_rl_core.engines.distributed import select_accelerator

        select_accelerator()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
