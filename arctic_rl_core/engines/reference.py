"""The reference policy: a frozen model that scores log-probs for KL terms and never trains.

It loads the policy's initial weights (or its own checkpoint) with the same attention as the trainer,
so the backend's micro-batches (ZoRRo's prefix forests included) run through it unchanged and its
log-probs are exact the same way: checked at load against the model's own forward, as the trainer's
are. No optimizer, no gradients; it lives in the backend's process, on the trainer's device kind, or, with
`reference.offload`, in pinned host memory between calls (frozen weights need no copy back).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.models.router_replay import load_router_replay
from arctic_rl_core.engines.response_logits import ResponseLogits, inputs_on_device, response_outputs
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.determinism import inference_behaviour
from arctic_rl_core.models.exactness import check_exactness, zorro_attention_possible
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
from arctic_rl_core.models.head import output_head
from arctic_rl_core.models.loading import load_causal_lm, pad_token_id
from arctic_rl_core.models.rope_scaling import model_config
from arctic_rl_core.types import MODEL_SHAPE_KEYS, model_shape


class ReferenceModel:
    def __init__(self, config: BackendConfig):
        from transformers import AutoConfig

        rc = config.reference
        self.model_path = rc.model_path or config.model_path
        if not os.path.isdir(self.model_path):
            raise InvalidRequest("reference.model_path", f"{self.model_path!r} is not a directory")
        hf_config = model_config(self.model_path, config.rope_scaling, "reference.model_path")
        policy = model_shape(AutoConfig.from_pretrained(config.model_path).to_dict())
        differing = [k for k in MODEL_SHAPE_KEYS if model_shape(hf_config.to_dict())[k] != policy[k]]
        if differing:
            raise InvalidRequest("reference.model_path", f"is not a model of the policy's shape (differs in "
                                                         f"{', '.join(differing)}): KL needs the same vocabulary")
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        dtype = getattr(torch, rc.dtype or config.engine.dtype)
        zorro = config.zorro.enable or zorro_attention_possible(hf_config)
        model, self.zorro_loaded = load_causal_lm(self.model_path, hf_config, dtype, config.engine.attn_implementation,
                                                  zorro=zorro, required=config.zorro.enable)
        model.requires_grad_(False)
        self.model = ResponseLogits(model, model, output_head(hf_config), config.zorro.attention_backend).to(self.device)
        inference_behaviour(self.model)
        self.weights_fingerprint = checkpoint_fingerprint(self.model_path)
        check_exactness(self.model, self.model, model, zorro=self.zorro_loaded, pad_id=pad_token_id(hf_config),
                        vocab_size=hf_config.vocab_size, device=self.device, dtype=dtype)
        if config.router_replay != "off" and rc.router_replay:
            self.model.router_replay = load_router_replay(model, hf_config, self.device)
        self.offload = rc.offload
        if self.offload:
            pin, copies = self.device.type == "cuda", {}
            # Tied weights (an embedding shared with the output head) stay one tensor, parked and on the device.
            self._parked = {key: copies.setdefault(id(t), t.detach().cpu().pin_memory() if pin else t.detach().cpu())
                            for key, t in self._tensors().items()}
            self._place(self._parked)

    def _tensors(self) -> dict[tuple[torch.nn.Module, str, bool], torch.Tensor]:
        """Every parameter and buffer, keyed by (module, name, is_parameter)."""
        found = {}
        for module in self.model.modules():
            found.update({(module, name, True): p for name, p in module._parameters.items() if p is not None})
            found.update({(module, name, False): b for name, b in module._buffers.items() if b is not None})
        return found

    def _place(self, tensors: dict) -> None:
        for (module, name, is_parameter), tensor in tensors.items():
            if is_parameter:
                module._parameters[name].data = tensor
            else:
                module._buffers[name] = tensor

    @contextmanager
    def _resident(self):
        """The weights on the device for one call; parked in host memory again after it."""
        if not self.offload:
            yield
            return
        on_device = {}
        self._place({key: on_device.setdefault(id(t), t.to(self.device, non_blocking=True))
                     for key, t in self._parked.items()})
        try:
            yield
        finally:
            self._place(self._parked)

    @torch.no_grad()
    def forward(self, micro_batches: list[MicroBatch], post, with_entropy: bool):
        """Per-token "logprobs" (and "entropy") of each micro-batch, as `TrainingEngine.forward` returns them."""
        results = []
        with self._resident():
            for mb in micro_batches:
                mb.inputs = inputs_on_device(mb.inputs, self.device)
                if self.model.router_replay is None:  # its own routing (reference.router_replay off)
                    mb = dataclasses.replace(mb, routes=None, routes_known=None)
                out = response_outputs(self.model, mb, post, with_entropy, self.device)
                results.append((mb, {k: v.float().cpu() for k, v in out.items() if k in ("logprobs", "entropy")}))
        return results

    def describe(self) -> dict:
        return {"model_path": self.model_path, "weights_fingerprint": self.weights_fingerprint, "zorro": self.zorro_loaded,
                "device": str(self.device), "offload": self.offload,
                "router_replay": getattr(self.model, "router_replay", None) is not None}

