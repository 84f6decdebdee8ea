"""Plugin discovery through the `arctic_rl` entry-point group, with real installed distributions."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from arctic_rl_core.errors import UnknownName
from arctic_rl_core.losses.registry import Registered, Registry, register_loss_fn
from arctic_rl_core.plugins import load_plugins
from tests.helpers import grpo_batch

GOOD = '''
import torch
from arctic_rl_core import register_loss_fn
from arctic_rl_core.plugins import hookimpl


@register_loss_fn("mean_negative_logprob_x2", requires=("advantages",))
def doubled_nll(outputs, inputs, config):
    loss = inputs.aggregate(-2.0 * outputs["logprobs"], "token-mean")
    return loss, {"doubled": loss.detach()}


@hookimpl
def arctic_rl_loss_fns():
    return [doubled_nll]


@hookimpl
def arctic_rl_framework_adapters():
    return {"toyframework": "toyframework.backend=arctic_rl"}
'''

BROKEN = '''
raise ImportError("toy plugin needs the package 'nonexistent_dependency'")
'''


def write_distribution(root, name, module_source):
    module = name.replace("-", "_")
    os.makedirs(root / module)
    (root / module / "__init__.py").write_text(textwrap.dedent(module_source))
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"
            [project]
            name = "{name}"
            version = "0.3.1"
            [project.entry-points.arctic_rl]
            {module} = "{module}"
            [tool.setuptools]
            packages = ["{module}"]
            """
        )
    )


@pytest.fixture(scope="module")
def installed_plugins(tmp_path_factory):
    """Two throwaway distributions installed with pip into a private target directory."""
    target = tmp_path_factory.mktemp("site")
    for name, source in (("toy-arctic-loss", GOOD), ("toy-broken-plugin", BROKEN)):
        src = tmp_path_factory.mktemp(name)
        write_distribution(src, name, source)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
            check=True,
        )
    sys.path.insert(0, str(target))
    try:
        yield target, load_plugins()
    finally:
        sys.path.remove(str(target))


def test_builtins_are_listed_with_their_distribution():
    report = load_plugins().report()
    listed = {(p["kind"], p["name"]): p["distribution"] for p in report["plugins"]}
    for name in ("sft", "importance_sampling", "grpo"):
        assert listed[("loss", name)] == "arctic-rl"
    for name in ("apply_temperature", "compute_logprobs", "compute_entropy"):
        assert listed[("post_processor", name)] == "arctic-rl"
    assert listed[("engine", "deepspeed")] == "arctic-rl"
    assert listed[("sampler", "transformers")] == "arctic-rl"


def test_installed_plugin_is_discovered_and_broken_one_reported(installed_plugins):
    _, manager = installed_plugins
    listed = {(p.kind, p.name): (p.distribution, p.version) for p in manager.provided}
    assert listed[("loss", "mean_negative_logprob_x2")] == ("toy-arctic-loss", "0.3.1")
    assert listed[("adapter", "toyframework")] == ("toy-arctic-loss", "0.3.1")
    assert ("loss", "grpo") in listed  # the broken plugin did not stop the others
    [failure] = manager.failures
    assert failure.distribution == "toy-broken-plugin" and failure.stage == "load"
    assert "nonexistent_dependency" in failure.error


def test_plugin_loss_is_usable_through_fwd_bwd(installed_plugins, make_backend):
    backend = make_backend()
    batch = grpo_batch(groups=1)
    plugin = backend.fwd_bwd(batch, "mean_negative_logprob_x2")
    sft = make_backend().fwd_bwd(batch, "sft")
    assert plugin.loss == pytest.approx(2 * sft.loss, rel=1e-6)
    assert plugin.metrics["doubled"] == pytest.approx(plugin.loss)


def test_registries_belong_to_their_manager_not_to_imports(installed_plugins, tiny_model):
    """A manager's registries hold what its plugins returned; importing a plugin module registers nothing,
    and a backend uses the manager it was given."""
    import toy_arctic_loss  # noqa: F401  (imported: its decorator ran)
    from arctic_rl_plugins import builtin

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.plugins import PluginManager
    from tests.conftest import LIGHT_SAMPLER

    with_plugin, bare = installed_plugins[1], PluginManager()
    assert "mean_negative_logprob_x2" in with_plugin.losses.names()
    assert load_plugins().losses is not with_plugin.losses
    assert bare.losses.names() == [] and bare.engines == {}
    only_builtin = PluginManager()
    only_builtin.add(builtin, "builtin")
    assert "mean_negative_logprob_x2" not in only_builtin.losses.names() and "grpo" in only_builtin.losses.names()
    backend = InProcessBackend({"model_path": tiny_model, "sampler": LIGHT_SAMPLER}, plugins=only_builtin)
    before = backend.state_digest()
    with pytest.raises(UnknownName, match="mean_negative_logprob_x2"):
        backend.fwd_bwd(grpo_batch(groups=1), "mean_negative_logprob_x2")
    assert backend.state_digest() == before


def test_cli_lists_plugins_and_failures_as_json(installed_plugins):
    target, _ = installed_plugins
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "arctic_rl_core.cli", "plugins", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    names = {(p["name"], p["distribution"]) for p in report["plugins"]}
    assert ("mean_negative_logprob_x2", "toy-arctic-loss") in names and ("grpo", "arctic-rl") in names
    assert [f["distribution"] for f in report["failures"]] == ["toy-broken-plugin"]
    assert "nonexistent_dependency" in report["failures"][0]["error"]
    strict = subprocess.run([sys.executable, "-m", "arctic_rl_core.cli", "plugins", "--strict"], env=env,
                            capture_output=True, text=True)
    assert strict.returncode == 1 and "BROKEN" in strict.stdout


def test_registering_a_taken_name_with_another_function_fails():
    registry = Registry("loss")
    registry.add(Registered("x", print, source="a"))
    registry.add(Registered("x", print, source="a"))  # the same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        registry.add(Registered("x", len, source="b"))
    losses = load_plugins().losses
    shadow = register_loss_fn("grpo")(lambda outputs, inputs, config: None)
    with pytest.raises(ValueError, match="already registered"):
        losses.add(shadow.arctic_rl_registered)
    assert losses.entries["grpo"].fn.__name__ == "grpo_loss"
