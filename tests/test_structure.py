"""The structure reads from the code: an import graph without circles, and a core that imports
none of its consumers (recipes, benchmarks, adapters) nor the plugins it discovers."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"arctic_rl_core": ".", "arctic_rl_kernels": "kernels", "arctic_rl_plugins": "plugins",
           "arctic_rl_recipes": "recipes", "arctic_rl_bench": "benchmarks", "arctic_rl_verl": "adapters/verl"}


def _modules() -> dict[str, str]:
    """Module name -> file, for every module of the project's packages."""
    out = {}
    for package, folder in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for directory, _, files in os.walk(os.path.join(base, package)):
            for name in files:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(directory, name), base)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(directory, name)
    return out


def import_graph() -> dict[str, set[str]]:
    """Every import, at module level or inside a function, from one project module to another."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module attribute
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "arctic_rl_core.calls" in graph["arctic_rl_core.client"]  # module level
    assert "arctic_rl_core.doctor" in graph["arctic_rl_core.cli"]  # inside a function
    assert "arctic_rl_kernels.layout" in graph["arctic_rl_core.batching"]


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_core_imports_none_of_its_consumers():
    graph = import_graph()
    outside = {"arctic_rl_recipes", "arctic_rl_bench", "arctic_rl_verl", "arctic_rl_plugins"}
    leaks = {(m, t) for m, targets in graph.items() if m.startswith("arctic_rl_core")
             for t in targets if t.split(".")[0] in outside}
    assert leaks == set()
    # the kernels stand alone: they import torch, never the core
    assert not {t for m, targets in graph.items() if m.startswith("arctic_rl_kernels") for t in targets
                if not t.startswith("arctic_rl_kernels")}
