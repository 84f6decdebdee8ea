"""Loading the trainer's model: safetensors only, no dropout, and load failures as request errors."""

from __future__ import annotations

import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.determinism import without_dropout


def load_causal_lm(model_path: str, hf_config, dtype: torch.dtype, attn_implementation: str, zorro: bool):
    from transformers import AutoModelForCausalLM

    try:
        # safetensors only: a model folder's *.bin files are pickles.
        model = AutoModelForCausalLM.from_pretrained(model_path, config=without_dropout(hf_config), dtype=dtype,
                                                     attn_implementation=attn_implementation, use_safetensors=True)
    except (OSError, ValueError) as err:
        raise InvalidRequest("model_path", f"{model_path!r} has no loadable causal-LM weights: {err}") from None
    except Exception as err:  # noqa: BLE001 -- e.g. a family keying its own attention classes by implementation name
        if zorro:
            raise InvalidRequest("zorro.enable", f"{hf_config.model_type}: cannot be built with ZoRRo's attention "
                                                 f"({type(err).__name__}: {err}); set zorro.enable=false to train it "
                                                 "with its own attention") from None
        raise InvalidRequest("model_path", f"{model_path!r}: {type(err).__name__}: {err}") from None
    # Dropout modules built with a fixed probability (not read from the config) are zeroed too.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
