"""zorro.inference's wiring into vLLM, without starting an engine (tests/test_vllm_sampler.py runs vLLM with it):
what is refused at start-up, by field, and a plugin that changes nothing unless asked to."""

from importlib.metadata import entry_points

import pytest
import triton

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.samplers import vllm_forest_cascade as forest_cascade


def test_a_cpu_without_the_interpreter_is_refused_before_anything_starts(tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # Triton's knob reads it at each use
    assert not triton.knobs.runtime.interpret
    with pytest.raises(InvalidRequest, match="zorro.inference: forest cascade attention runs Triton kernels on CUDA"):
        InProcessBackend({"model_path": tiny_model, "zorro": {"inference": True}})


def test_bf16_under_the_interpreter_is_refused_on_the_sampler_dtype(tiny_model):
    # Triton's interpreter multiplies bf16 bit patterns in tl.dot: attention would be wrong, not slow.
    with pytest.raises(InvalidRequest, match="sampler.dtype: bfloat16 under Triton's interpreter"):
        InProcessBackend({"model_path": tiny_model, "zorro": {"inference": True}, "sampler": {"dtype": "bfloat16"}})


def test_another_vllm_release_is_refused(tiny_model, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.11.2")
    with pytest.raises(InvalidRequest, match="zorro.inference: the forest cascade backend is built on vLLM 0.32"):
        InProcessBackend({"model_path": tiny_model, "zorro": {"inference": True}})


def test_zorro_inference_needs_the_vllm_sampler(tiny_model):
    with pytest.raises(InvalidRequest, match="zorro.inference is forest cascade attention inside vLLM"):
        InProcessBackend({"model_path": tiny_model, "zorro": {"inference": True}, "sampler": {"name": "transformers"}})


def test_the_vllm_plugin_is_declared_and_inert_unless_asked(monkeypatch):
    from vllm.v1.attention.backends import registry

    [plugin] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "arctic_rl_forest_cascade"]
    assert plugin.load() is forest_cascade.enable_in_worker
    monkeypatch.delenv(forest_cascade.ENV, raising=False)
    before = dict(registry._ATTN_OVERRIDES)
    forest_cascade.enable_in_worker()  # every vLLM process of this environment calls it
    assert registry._ATTN_OVERRIDES == before
