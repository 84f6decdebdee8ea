"""A distributed configuration the job cannot run is refused, naming the setting, before Ray starts."""

import pytest

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.errors import InvalidRequest


@pytest.mark.parametrize("change, field, words", [
    ({"engine": {"ranks": 2, "zero_stage": 3, "lora": {"r": 4}}}, "config.engine.lora", "zero_stage 0-2"),
    ({"sampler": {"name": "transformers", "replicas": 2, "sync": "file"}}, "config.sampler.sync", "not file"),
    ({"model_path": "/nonexistent/model", "engine": {"ranks": 2}}, "model_path", "not a directory"),
    ({"placement": "side_by_side", "engine": {"ranks": 2}}, "config.placement", "colocated"),
    ({"sampler": {"name": "transformers", "adapters": 2}}, "config.sampler", "set engine.lora"),
    ({"engine": {"lora": {"r": 4}, "dtype": "bfloat16"}, "sampler": {"name": "transformers", "adapters": 2}},
     "config.sampler", "float32 only"),
    ({"engine": {"lora": {"r": 4}}, "sampler": {"adapters": 2}, "zorro": {"inference": True}}, "config.zorro",
     "sampler.adapters"),
    ({"engine": {"ranks": 2}, "ray": {"trainer_nodes": {"resources": {"CPU": 2}}}},
     "config.ray.trainer_nodes.resources", "'CPU' is set by the job itself"),
    ({"engine": {"ranks": 2}, "ray": {"sampler_nodes": {"resources": {"slot": 0}}}},
     "config.ray.sampler_nodes.resources", "'slot': the amount must be positive"),
    ({"engine": {"ranks": 2}, "ray": {"trainer_nodes": {"labels": {"zone": "!b"}}}},
     "config.ray.trainer_nodes.labels", "one exact value"),
    ({"engine": {"ranks": 2}, "sampler": {"replicas": 2}, "ray": {"trainer_nodes": {"labels": {"pool": "a"}},
                                                                  "sampler_nodes": {"labels": {"pool": "b"}}}},
     "config.ray", "sampler_nodes.labels ['pool'] differ from trainer_nodes.labels"),
])
def test_refused_before_any_actor_or_ray_starts(tiny_model, change, field, words):
    import ray

    with pytest.raises(InvalidRequest) as err:
        InProcessBackend({"model_path": tiny_model, **change})
    assert err.value.field == field and words in str(err.value)
    assert not ray.is_initialized()
