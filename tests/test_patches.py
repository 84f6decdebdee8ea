"""Runtime changes to other projects' code are recorded patches: listed, refused twice, revertible."""

import json
import os
import subprocess
import sys
import types

import pytest

from arctic_rl_core.patches import InstancePatch, Patch, PatchConflict, applied, environment, set_item


def _row(label):
    return next(row for row in applied() if row["patch"] == label)


def test_an_attribute_patch_records_itself_refuses_twice_and_reverts():
    module = types.ModuleType("toy_library")
    module.compute = lambda x: x + 1
    patch = Patch(module, "compute", lambda original: (lambda x: 2 * original(x)), "toy: doubled", by="tests").apply()
    assert module.compute(1) == 4 and _row("toy_library.compute")["active"] == 1
    with pytest.raises(PatchConflict, match="already patched"):
        Patch(module, "compute", lambda original: original, "again").apply()
    assert module.compute(1) == 4  # the refused patch changed nothing
    patch.revert()
    assert module.compute(1) == 2 and _row("toy_library.compute") == {
        "patch": "toy_library.compute", "reason": "toy: doubled", "by": "tests", "count": 1, "active": 0}


def test_registry_entries_and_environment_variables_are_patches():
    registry = {}
    set_item(registry, ("toy", "async"), "toy.Adapter", "toy registry", where="toy.REGISTRY")
    assert registry == {("toy", "async"): "toy.Adapter"}
    assert _row("toy.REGISTRY[('toy', 'async')]")["active"] == 1
    name = "ARCTIC_RL_TEST_PATCH_VARIABLE"
    assert name not in os.environ
    with environment(name, "1", "toy library reads it at start-up").applied():
        assert os.environ[name] == "1"
    assert name not in os.environ
    assert _row(f"os.environ[{name!r}]") ["active"] == 0


def test_an_instance_patch_is_marked_on_its_instance_and_keeps_nothing_alive():
    import gc
    import weakref

    class Model:
        pass

    def flag_layers(model):
        model.layers = [1, 2, 3]
        return len(model.layers)

    patch = InstancePatch("layers flagged", flag_layers, "toy reason", by="tests")
    model = Model()
    assert patch.apply(model) == 3
    with pytest.raises(PatchConflict):
        patch.apply(model)
    assert patch.apply(Model()) == 3  # another instance is another target
    row = next(r for r in applied() if r["patch"].endswith("Model instance: layers flagged"))
    assert row["count"] == 2 and row["objects"] == 6
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_doctor_lists_the_patches_of_its_process():
    import torch

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-m", "arctic_rl_core.cli", "doctor", "--json"], capture_output=True,
                         text=True, check=True, env=env)
    rows = {row["patch"]: row for row in json.loads(out.stdout)["patches"]}
    # on a CPU machine the doctor selects DeepSpeed's CPU accelerator, itself a recorded change
    expected = set() if torch.cuda.is_available() else {"os.environ['DS_ACCELERATOR']"}
    assert set(rows) == expected
    for row in rows.values():
        assert row["by"] == "arctic_rl_core.engines.distributed" and row["active"] == 1
