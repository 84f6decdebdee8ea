"""The recipes' plugin: `arctic-rl train`, `arctic-rl demo` and `arctic-rl eval longbench` (entry point
`arctic_rl: recipes`)."""

from __future__ import annotations

from arctic_rl_core.plugins import Command, hookimpl


def _train_arguments(p) -> None:
    p.add_argument("recipe", help="recipe YAML, or a bundled name (text2sql_tiny, multihop_tiny)")
    p.add_argument("overrides", nargs="*", help="VeRL-style overrides, e.g. grpo.steps=50 backend.url=http://host:7000")


def _train(args) -> int:
    from arctic_rl_recipes.run import main

    return main(args)


def _demo_arguments(p) -> None:
    p.add_argument("--recipe", default="text2sql_tiny", help="recipe file or bundled name")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--rounds", type=int, default=2, help="speed measurement: rounds over the four variants")
    p.add_argument("--steps", type=int, default=3, help="speed measurement: steps per variant per round")
    p.add_argument("overrides", nargs="*", help="recipe overrides, key.path=value")


def _demo(args) -> int:
    from arctic_rl_recipes.demo import main

    return main(args)


def _longbench_arguments(p) -> None:
    from arctic_rl_recipes.longbench import add_arguments

    add_arguments(p)


def _longbench(args) -> int:
    from arctic_rl_recipes.longbench import main

    return main(args)


@hookimpl
def arctic_rl_commands():
    return [
        Command(("train",), "run a GRPO recipe: arctic-rl train RECIPE.yaml [key.path=value ...]", _train_arguments, _train),
        Command(("demo",), "the tiny text2sql GRPO recipe end to end, then its ZoRRo and pipelining speed ratios",
                _demo_arguments, _demo),
        Command(("eval", "longbench"), "LongBench v1's QA tasks (its data, templates and QA F1) on a model or a server",
                _longbench_arguments, _longbench),
    ]
