"""The output head as each family's own forward applies it after `lm_head`.

Log-probs are only the model's own if the logits are: Cohere multiplies by `logit_scale`,
Granite divides by `logits_scaling` (HyperCLOVA X multiplies by it; MiniCPM3 divides the final
hidden states by it), Falcon-H1 multiplies
by `lm_head_multiplier`, Gemma 2/3 and nanochat cap them with `final_logit_softcapping`.
The table below is checked, not trusted: at load the engine compares this head with the
model's own `forward(...).logits` and refuses a family whose head it does not reproduce
(`arctic_rl_core.models.exactness`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputHead:
    divide_hidden: float | None = None
    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def __call__(self, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.divide_hidden is not None:
            hidden = hidden / self.divide_hidden
        logits = lm_head(hidden)
        # The same operations in the same order as the families' forwards: bit-for-bit their logits.
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _attr(name: str, op: str):
    return lambda config: {op: getattr(config, name)}


_SCALING = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _attr("logit_scale", "multiply")),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid"),
                    _attr("logits_scaling", "divide")),
    "hyperclovax": _attr("logits_scaling", "multiply"),
    "falcon_h1": _attr("lm_head_multiplier", "multiply"),
    "minicpm3": _attr("logits_scaling", "divide_hidden"),
}


def output_head(config) -> OutputHead:
    """The head of `config`'s family: its scaling (by model type) and its final softcap (wherever configured)."""
    text = config.get_text_config()
    scaling = _SCALING.get(text.model_type, _SCALING.get(config.model_type, lambda c: {}))(text)
    return OutputHead(**scaling, softcap=getattr(text, "final_logit_softcapping", None))
