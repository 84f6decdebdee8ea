"""The `arctic-rl` command line: the core's commands, and those installed plugins add (`train`, `demo`, `bench …`)."""

from __future__ import annotations

import argparse
import json
import sys

from arctic_rl_core.models.tiny import FAMILIES, MOE_FAMILIES
from arctic_rl_core.plugins.manager import PluginManager, load_plugins


def _cmd_plugins(args) -> int:
    report = load_plugins().report()
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
    print(f"patches applied in this process: {len(report['patches'])}")
    for row in report["patches"]:
        print(f"  {row['patch']} (x{row['count']}, {row['active']} active, by {row['by']}): {row['reason']}")
    return 0


def _cmd_make_tiny_model(args) -> int:
    from arctic_rl_core.models.tiny import make_tiny_model

    path = make_tiny_model(args.family, args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                           kv_heads=args.kv_heads, vocab_size=args.vocab_size, max_positions=args.max_positions,
                           seed=args.seed)
    print(path)
    return 0


def _cmd_serve(args) -> int:
    from arctic_rl_core.server.run import main

    return main(args)


def build_parser(plugins: PluginManager | None = None) -> argparse.ArgumentParser:
    plugins = plugins if plugins is not None else load_plugins()
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
    p.add_argument("--family", choices=list(FAMILIES + MOE_FAMILIES), default="qwen3")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("serve", help="serve the training API over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=7000)
    p.add_argument("--config", help="YAML backend config: the job to load at start (else POST /v1/initialize)")
    p.add_argument("--token", help="bearer token required on every request (or $ARCTIC_RL_TOKEN)")
    p.add_argument("--max-request-mb", type=int, default=1024, help="request body cap")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections beyond N are answered 503 (default 1024: an agent fleet's concurrent "
                        "requests each hold one)")
    p.add_argument("--served-model-name", help="the model name the OpenAI-compatible routes answer to "
                                               "(default: the job's model_path)")
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="read chat replies' tool calls into tool_calls with vLLM's parser NAME (hermes, llama3_json, "
                        "...: vllm serve's option of that name, with its strict tool calling)")
    p.add_argument("--tinker-full-parameter", action="store_true",
                   help="the Tinker routes train all parameters of a job without LoRA for clients that ask for LoRA "
                        "(the Tinker SDK can ask for nothing else); without it they are refused")
    p.add_argument("--tinker-tenants", type=int, default=8, metavar="N",
                   help="Tinker models that train at once, time-sharing the engine, each from the base model "
                        "(default 8)")
    p.add_argument("--tinker-keys", metavar="FILE",
                   help="a JSON object of Tinker tenant name -> API key: only these keys are taken on the Tinker "
                        "routes, and each tenant sees only its own models (default: any key, each its own tenant)")
    p.add_argument("--checkpoint-dir", default="checkpoints",
                   help="every checkpoint path a request names must resolve inside this directory (default ./checkpoints)")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                   help="a per-request work cap (docs/server.md lists them), e.g. --limit samples_per_prompt=64")
    p.set_defaults(func=_cmd_serve)

    _add_plugin_commands(sub, plugins)
    return parser


def _add_plugin_commands(sub, plugins: PluginManager) -> None:
    """Commands from plugins (the recipes' `train` and `demo`, the benchmarks' `bench …`), nested by path."""
    groups = {(): sub}
    for path, command in sorted(plugins.commands.items()):
        for depth in range(1, len(path)):
            parent = path[:depth]
            if parent not in groups:
                group = groups[parent[:-1]].add_parser(parent[-1], help=f"{parent[-1]} commands")
                groups[parent] = group.add_subparsers(dest=f"{'_'.join(parent)}_command", required=True)
        p = groups[path[:-1]].add_parser(path[-1], help=command.help)
        try:
            command.add_arguments(p)
        except ImportError as err:  # a module of an extra that is not installed: every other command still runs
            p.set_defaults(func=_cannot_run(" ".join(path), err), needs_accelerator=False)
            continue
        p.set_defaults(func=command.run, needs_accelerator=command.needs_accelerator)


def _cannot_run(name: str, err: ImportError):
    def refuse(args) -> int:
        print(f"arctic-rl {name} cannot run here: {err} (a package of an extra that is not installed: "
              f"pyproject.toml's optional dependencies name them, e.g. pip install 'arctic-rl[recipes]')", file=sys.stderr)
        return 2
    return refuse


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "needs_accelerator", args.command != "plugins"):  # plugins must stay light: no torch import
        from arctic_rl_core.engines.distributed import select_accelerator

        select_accelerator()
    return args.func(args)


def run() -> None:
    """The `arctic-rl` command: `main`, then the process ends with its status (arctic_rl_core/process_exit.py)."""
    from arctic_rl_core.process_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
