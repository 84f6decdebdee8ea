"""What installs where: the client installs light, each folder holds its package under its own
name, and framework adapters are distributions of their own."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "deepspeed", "vllm", "ray", "transformers")
PACKAGES = {"arctic_rl_core": "arctic_rl_core", "arctic_rl_kernels": "kernels/arctic_rl_kernels",
            "arctic_rl_plugins": "plugins/arctic_rl_plugins", "arctic_rl_recipes": "recipes/arctic_rl_recipes",
            "arctic_rl_bench": "benchmarks/arctic_rl_bench"}


def _requirement_names(requirements) -> set[str]:
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower() for r in requirements}


def test_base_requirements_are_light():
    base = [r for r in importlib.metadata.requires("arctic-rl") if "extra ==" not in r]
    names = _requirement_names(base)
    assert {"pydantic", "httpx", "numpy"} <= names and not names & set(HEAVY), names


def test_client_imports_without_heavy_packages():
    code = ("import sys, json; import arctic_rl_core.client, arctic_rl_core.wire, arctic_rl_core.calls, "
            "arctic_rl_core.plugins; "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_each_folder_holds_its_package_under_its_own_name(tmp_path):
    """No package-dir remapping: the module a reader finds at <folder>/<package>/ is the one imported."""
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
    assert "package-dir" not in project["tool"]["setuptools"]
    code = ("import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n).submodule_search_locations[0] "
            f"for n in {list(PACKAGES)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    found = {name: os.path.realpath(path) for name, path in json.loads(out.stdout).items()}
    assert found == {name: os.path.realpath(os.path.join(ROOT, folder)) for name, folder in PACKAGES.items()}


def test_the_backend_registers_nothing_into_verl():
    """`pip install .` gives arctic-rl no `verl.plugins` entry point; the adapter's own distribution declares it."""
    groups = {ep.group for ep in importlib.metadata.distribution("arctic-rl").entry_points}
    assert "arctic_rl" in groups and "verl.plugins" not in groups
    adapter = tomllib.load(open(os.path.join(ROOT, "adapters", "verl", "pyproject.toml"), "rb"))["project"]
    assert adapter["name"] == "arctic-rl-verl"
    target = adapter["entry-points"]["verl.plugins"]["arctic_rl"]
    module_file = os.path.join(ROOT, "adapters", "verl", *target.split(".")) + ".py"
    assert os.path.isfile(module_file), target
    # it depends on the thin client only: no extras of the backend (no torch, DeepSpeed or vLLM of ours)
    assert "arctic-rl==0.1.0" in adapter["dependencies"]
