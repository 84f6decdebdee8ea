"""The module a training engine wraps: a causal LM returning logits only where responses are predicted."""

from __future__ import annotations

import torch

from arctic_rl_core.models.head import OutputHead
from arctic_rl_kernels.layout import ForestLayout


class ResponseLogits(torch.nn.Module):
    """Prompt positions never reach the LM head, which matters at real vocabulary sizes. The head is
    the family's own (`OutputHead`: its scaling and softcap), so these are the model's logits.

    Given `zorro_layout`, the batch is one packed prefix forest and attention is
    ZoRRo's split attention (the model must be loaded with that attention
    implementation); otherwise a right-padded batch.
    """

    def __init__(self, model: torch.nn.Module, causal_lm: torch.nn.Module, head: OutputHead, zorro_backend: str = "auto"):
        super().__init__()
        self.model = model
        self._causal_lm = [causal_lm]  # a list: not a second registration of the same parameters
        self.head = head
        self.zorro_backend = zorro_backend
        self.last_delivery = None
        """The attention calls of the last packed forward (`Delivery`: checked at load)."""

    def forward(self, input_ids: torch.Tensor, logit_rows: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, zorro_layout: ForestLayout | None = None) -> torch.Tensor:
        lm = self._causal_lm[0]
        decoder = _decoder(lm)
        if zorro_layout is not None:
            from arctic_rl_core.zorro.attention import expect_layout

            with expect_layout(zorro_layout) as delivery:
                hidden = decoder(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False,
                    zorro_layout=zorro_layout, zorro_backend=self.zorro_backend,
                ).last_hidden_state
            self.last_delivery = delivery
        else:
            hidden = decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, logit_rows)
        return self.head(lm.get_output_embeddings(), rows)


def _decoder(lm: torch.nn.Module) -> torch.nn.Module:
    """The causal LM's decoder (its final hidden states), also where `base_model_prefix` names no attribute."""
    base = lm.base_model
    return lm.model if base is lm and isinstance(getattr(lm, "model", None), torch.nn.Module) else base
