"""The client and adapters install light: no torch, DeepSpeed, vLLM or Ray in the base install or on import."""

import importlib.metadata
import json
import subprocess
import sys

HEAVY = ("torch", "deepspeed", "vllm", "ray", "transformers")


def test_base_requirements_are_light():
    base = [r for r in importlib.metadata.requires("arctic-rl") if "extra ==" not in r]
    names = {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower() for r in base}
    assert names and not names & set(HEAVY), names


def test_client_and_adapters_import_without_heavy_packages():
    code = (
        "import sys, json; import arctic_rl_core.client, arctic_rl_core.wire, arctic_rl_adapters.verl, "
        "arctic_rl_adapters.skyrl, arctic_rl_adapters.primerl, arctic_rl_plugins.hookspecs; "
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_namespaced_imports_only(tmp_path):
    """Installed, the folders import as arctic_rl_*; no top-level `adapters`, `plugins` or `kernels` exists."""
    code = (
        "import importlib.util, json; "
        "print(json.dumps({n: importlib.util.find_spec(n) is not None for n in "
        "['adapters', 'plugins', 'kernels', 'arctic_rl_adapters', 'arctic_rl_plugins', 'arctic_rl_kernels', 'arctic_rl_core']}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert json.loads(out.stdout) == {"adapters": False, "plugins": False, "kernels": False, "arctic_rl_adapters": True,
                                      "arctic_rl_plugins": True, "arctic_rl_kernels": True, "arctic_rl_core": True}
