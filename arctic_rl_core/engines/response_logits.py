"""The module a training engine wraps: a causal LM returning logits only where responses are predicted."""

from __future__ import annotations

import torch

from arctic_rl_kernels.layout import ForestLayout


class ResponseLogits(torch.nn.Module):
    """Prompt positions never reach the LM head, which matters at real vocabulary sizes.

    Given `zorro_layout`, the batch is one packed prefix forest and attention is
    ZoRRo's split attention (the model must be loaded with that attention
    implementation); otherwise a right-padded batch.
    """

    def __init__(self, model: torch.nn.Module, causal_lm: torch.nn.Module, zorro_backend: str = "auto"):
        super().__init__()
        self.model = model
        self._causal_lm = [causal_lm]  # a list: not a second registration of the same parameters
        self.zorro_backend = zorro_backend

    def forward(self, input_ids: torch.Tensor, logit_rows: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, zorro_layout: ForestLayout | None = None) -> torch.Tensor:
        lm = self._causal_lm[0]
        extra = {"zorro_layout": zorro_layout, "zorro_backend": self.zorro_backend} if zorro_layout is not None else {}
        hidden = lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra
        ).last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, logit_rows)
        return lm.get_output_embeddings()(rows)
