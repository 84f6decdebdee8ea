"""Loading the trainer's model: safetensors only, no dropout, and load failures as request errors."""

from __future__ import annotations

import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.determinism import without_dropout


def load_causal_lm(model_path: str, hf_config, dtype: torch.dtype, own_attention: str, *, zorro: bool,
                   required: bool):
    """The model with ZoRRo's attention if `zorro` (else `own_attention`); returns (model, whether ZoRRo's).
    A family that cannot be built with ZoRRo's attention is an error if it is `required`, else built with
    its own."""
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.zorro.attention import ZORRO_ATTENTION

    def load(attention: str):
        # safetensors only: a model folder's *.bin files are pickles.
        return AutoModelForCausalLM.from_pretrained(model_path, config=without_dropout(hf_config), dtype=dtype,
                                                    attn_implementation=attention, use_safetensors=True)

    try:
        model = load(ZORRO_ATTENTION if zorro else own_attention)
    except (OSError, ValueError) as err:
        raise InvalidRequest("model_path", f"{model_path!r} has no loadable causal-LM weights: {err}") from None
    except Exception as err:  # noqa: BLE001 -- e.g. a family keying its own attention classes by implementation name
        if zorro and required:
            raise InvalidRequest("zorro.enable", f"{hf_config.model_type}: cannot be built with ZoRRo's attention "
                                                 f"({type(err).__name__}: {err}); set zorro.enable=false to train it "
                                                 "with its own attention") from None
        if not zorro:
            raise InvalidRequest("model_path", f"{model_path!r}: {type(err).__name__}: {err}") from None
        return load_causal_lm(model_path, hf_config, dtype, own_attention, zorro=False, required=False)
    # Dropout modules built with a fixed probability (not read from the config) are zeroed too.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model, zorro


def pad_token_id(hf_config) -> int:
    """The id the model pads with: its pad token, else its (first) EOS token, else 0."""
    pad = hf_config.pad_token_id if hf_config.pad_token_id is not None else hf_config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)
