"""The `arctic-rl` console script, `doctor`, tiny models of each family."""

import json
import os
import subprocess
import sys

import pytest
import torch

from arctic_rl_core.doctor import DOCTOR_LENGTHS
from arctic_rl_kernels import backend_timings
from arctic_rl_kernels.split_attention import auto_backend

CLI = [os.path.join(os.path.dirname(sys.executable), "arctic-rl")]


def run_cli(*args):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, check=True)


def forked_cli(*args) -> subprocess.CompletedProcess:
    """`arctic-rl ARGS` forked from an interpreter that has imported the libraries (tests/preimported.py): the
    console script's own start is test_console_script_plugins_json's."""
    from tests.preimported import arctic_rl

    return arctic_rl(*args, timeout=300)


def test_console_script_plugins_json():
    report = json.loads(run_cli("plugins", "--json").stdout)
    losses = {p["name"] for p in report["plugins"] if p["kind"] == "loss"}
    post = {p["name"] for p in report["plugins"] if p["kind"] == "post_processor"}
    assert {"sft", "importance_sampling", "grpo"} <= losses
    assert {"apply_temperature", "compute_logprobs", "compute_entropy"} <= post
    assert report["failures"] == []


def test_doctor_reports_engines_samplers_and_devices():
    doctor = forked_cli("doctor", "--json")
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    report = json.loads(doctor.stdout)
    assert report["packages"]["torch"] == torch.__version__
    assert report["components"]["engine:deepspeed"] == "usable"
    assert report["devices"]["cuda"]["available"] == torch.cuda.is_available()
    # ZoRRo's attention: what auto runs per dtype (measured on this device model, or the fixed order), and Triton
    # (interpreted in tests).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert report["devices"]["zorro_attention"] == {
        "auto": {name: {str(n): auto_backend(device, dtype, longest=n) for n in DOCTOR_LENGTHS}
                 for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))},
        "measured": backend_timings.last_measured(device),
        "triton": True,
    }
    assert "deepspeed" in report["engines"] and "transformers" in report["samplers"]


def test_a_command_whose_extra_is_missing_says_so_and_the_others_run():
    """Without pebble (the recipes extra), `bench e2e`, which drives the recipe, cannot run: it says why, and the
    rest of the command line (here `doctor`, `bench zorro`'s options) still works."""
    blocked = ("import sys, runpy; sys.modules['pebble'] = None; sys.argv = ['arctic-rl'] + sys.argv[1:]; "
               "runpy.run_module('arctic_rl_core.cli', run_name='__main__')")

    def cli(*args):
        return subprocess.run([sys.executable, "-c", blocked, *args], capture_output=True, text=True)
    assert cli("doctor", "--help").returncode == 0
    assert "--prompt-len" in cli("bench", "zorro", "--help").stdout
    refused = cli("bench", "e2e")
    assert refused.returncode == 2 and "arctic-rl bench e2e cannot run here" in refused.stderr, refused.stderr
    assert "pebble" in refused.stderr


@pytest.mark.parametrize("family, model_type", [("qwen3", "qwen3"), ("qwen2", "qwen2"), ("llama", "llama")])
def test_make_tiny_model_builds_each_family(tmp_path, family, model_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = forked_cli("make-tiny-model", "--family", family, "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                     str(tmp_path / family))
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.strip()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == model_type and model.config.hidden_size == 32
    assert model.config.vocab_size == len(tokenizer)
    text = "SELECT name FROM users WHERE age > 30;"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < len(text)  # BPE merged something
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_make_tiny_model_rejects_bad_shapes(tmp_path):
    bad = forked_cli("make-tiny-model", "--hidden", "30", "--heads", "4", str(tmp_path / "m"))
    assert bad.returncode != 0 and "multiple of heads" in bad.stderr


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_backend_trains_other_families(tiny_models, make_backend, family):
    from tests.helpers import grpo_batch

    backend = make_backend(model_path=tiny_models[family])
    digest = backend.state_digest()
    backend.fwd_bwd(grpo_batch(), "grpo")
    backend.step()
    assert backend.state_digest() != digest
    assert backend.sync_weights() == 1


def test_the_weights_fingerprint_tells_same_shape_checkpoints_apart(tmp_path):
    import shutil

    from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
    from arctic_rl_core.models.tiny import make_tiny_model

    base = make_tiny_model("llama", str(tmp_path / "base"), max_positions=64, seed=0)
    other = make_tiny_model("llama", str(tmp_path / "other"), max_positions=64, seed=1)
    copy = shutil.copytree(base, tmp_path / "copy")
    assert checkpoint_fingerprint(base) == checkpoint_fingerprint(str(copy)) is not None
    assert checkpoint_fingerprint(other) != checkpoint_fingerprint(base)
    assert checkpoint_fingerprint(str(tmp_path)) is None  # no weights in the folder itself
