"""RoPE scaling as one job setting: the model config every engine of a job loads, with the same positions.

The trainer, the reference and critic models and every sampler read the checkpoint's config through
`model_config`, and vLLM gets the same keys as `hf_overrides`: a job whose sampler ran YaRN while its trainer did
not would train on log-probs that are not the trained model's. What cannot be applied identically everywhere is
refused, naming the field.
"""

from __future__ import annotations

from arctic_rl_core.config import RopeScaling
from arctic_rl_core.errors import InvalidRequest

def model_config(model_path: str, rope_scaling: RopeScaling | None, field: str = "model_path"):
    """The checkpoint's Hugging Face config, with the job's RoPE scaling applied."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as err:
        raise InvalidRequest(field, f"{model_path!r} is not a Hugging Face model: {err}") from None
    for key, value in config_overrides(hf_config, rope_scaling).items():
        setattr(hf_config, key, value)
    return hf_config


def config_overrides(hf_config, rope_scaling: RopeScaling | None) -> dict:
    """The config keys the setting changes (also vLLM's `hf_overrides`): `rope_parameters`, transformers 5's and
    vLLM's name for the RoPE settings, and for YaRN and llama3 `max_position_embeddings`, the extended window (their
    convention, which transformers' YaRN and vLLM's maximum-length rule both assume; linear scaling keeps the
    trained window there)."""
    if rope_scaling is None:
        return {}
    family = hf_config.model_type
    current = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = current.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if any(isinstance(value, dict) for value in current.values()):
        raise InvalidRequest("rope_scaling", f"{family} sets RoPE per layer type ({', '.join(current)}); one "
                                             "setting for all layers is not supported")
    if theta is None:
        raise InvalidRequest("rope_scaling", f"{family} has no rotary position embedding to scale")
    if current.get("rope_type", "default") != "default":
        raise InvalidRequest("rope_scaling", f"the checkpoint's config already scales RoPE ({current['rope_type']}), "
                                             "and every engine applies it; remove rope_scaling")
    original = rope_scaling.original_max_position_embeddings or hf_config.max_position_embeddings
    parameters = {**current, "rope_theta": theta,
                  **rope_scaling.model_dump(exclude_none=True, exclude={"original_max_position_embeddings"})}
    if rope_scaling.rope_type == "linear":
        return {"rope_parameters": parameters}
    parameters["original_max_position_embeddings"] = original
    return {"rope_parameters": parameters, "max_position_embeddings": int(original * rope_scaling.factor)}


def context_window(hf_config) -> int:
    """Tokens a sequence may span under the config's RoPE: linear scaling stretches the trained window by its
    factor; the others already name the extended window in `max_position_embeddings`."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if parameters.get("rope_type") == "linear":
        return int(hf_config.max_position_embeddings * parameters["factor"])
    return hf_config.max_position_embeddings
