"""Runs inside vLLM's worker (`worker_extension_cls`): how new weights get into the engine.

vLLM mixes this class into its Worker. Where the model keeps its weights in
their checkpoint layout (the plain-weights loader on CPU), the worker can hand
the trainer its parameter tensors, or move them into a shared-memory file the
trainer maps, and the trainer writes each sync itself (`arctic_expose_weights`).
Otherwise every path ends in one load of checkpoint-format (Hugging Face named)
weights, which vLLM maps onto its fused layers: plain weights through the
model's `load_weights`, a copy into the tensors the forward pass reads; any
other through the worker's `reload_weights`, vLLM's layer-by-layer reload that
redoes the post-load processing (repacking, quantization). Either takes one
iterator over all weights, so the bucketed paths (broadcast, or shared-memory
slots between processes: `bucket_protocol`) stream their buckets through one.
"""

from __future__ import annotations

import sys

import torch

from arctic_rl_core.patches import InstancePatch
from arctic_rl_core.samplers.base import (process_random_state, random_state_bytes, random_state_tensors,
                                          set_process_random_state)
from arctic_rl_core.samplers.bucket_protocol import SharedSlot, join_group, receive_buckets, sync_device, tensor_at
from arctic_rl_core.samplers.vllm_plain_weights import MARKER as PLAIN_WEIGHTS
from arctic_rl_core.samplers.vllm_plain_weights import repack
from arctic_rl_core.samplers.vllm_routed_experts import RoutedExpertsExtension


def _prepack_on_updates(method) -> int:
    setup = method._setup_kernel

    def setup_kernel(layer, w13, w2):
        update = method.moe_kernel is not None
        setup(layer, w13, w2)
        if update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = setup_kernel
    return 1


PREPACK_EXPERTS_ON_UPDATES = InstancePatch(
    "a weight update also runs the experts' own post-load step (fused_experts.process_weights_after_loading)",
    _prepack_on_updates,
    "vLLM 0.32 runs it on the first load only: on CPU that step prepacks the experts into the grouped GEMM's layout, "
    "so after a reload the kernel read the new weights unpacked (a tiny Qwen3-MoE's MoE block off by more than its "
    "output's size)", __name__)


def prepack_experts_on_weight_updates(model: torch.nn.Module) -> int:
    """`PREPACK_EXPERTS_ON_UPDATES` on every unquantized mixture-of-experts layer of `model` (vLLM's reload path)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    methods = {id(m.quant_method): m.quant_method for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), UnquantizedFusedMoEMethod)}
    for method in methods.values():
        PREPACK_EXPERTS_ON_UPDATES.apply(method)
    return len(methods)


class WeightSyncExtension:
    def arctic_forest_cascade_served(self) -> dict:
        """Decoding steps this worker ran with forest cascade attention (zorro.inference), and without."""
        module = sys.modules.get("arctic_rl_core.samplers.vllm_forest_attention")
        return {} if module is None else dict(module.SERVED)

    def arctic_compute_threads(self) -> int:
        """The threads this worker's CPU model computes on (`vllm_core_executor`)."""
        return torch.get_num_threads()

    def arctic_load_weights(self, weights) -> int:
        """In-process engine: `weights` yields the trainer's tensors themselves (shared memory, no copy in transit)."""
        return self._arctic_reload(weights)

    def arctic_load_file(self, path: str) -> int:
        """File fallback: a safetensors file written by the trainer (never a pickle)."""
        from safetensors.torch import load_file

        return self._arctic_reload(load_file(path, device=str(sync_device())).items())

    def arctic_expose_weights(self, shared: bool) -> dict | None:
        """Where vLLM's weights live, for a trainer that writes them itself: the tensors (same process), or
        a shared-memory file they are moved into (another process on this host). Only weights kept in their
        checkpoint layout can be written from outside; otherwise None."""
        if not self._arctic_in_place() or self.vllm_config.model_config.quantization is not None:
            return None
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())  # a tied parameter appears once
        packed = {fused: list(shards) for fused, shards in getattr(model, "packed_modules_mapping", {}).items()}
        if not shared:
            return {"tensors": {name: p.data for name, p in params.items()}, "packed": packed}
        offsets, total = {}, 0
        for name, p in params.items():
            offsets[name] = total
            total += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned
        slot = SharedSlot(total)

        def into_slot(model) -> int:
            for name, p in params.items():
                view = tensor_at(slot.buffer, offsets[name], p.dtype, p.shape)
                view.copy_(p.data)
                p.data = view
            return len(params)

        InstancePatch("parameters' storage moved into a shared-memory file", into_slot,
                      "the trainer process maps that file and writes each sync into it", __name__).apply(model)
        self._arctic_weights_slot = slot  # mapped for the worker's lifetime
        return {"path": slot.path, "packed": packed,
                "params": {name: [offsets[name], str(p.dtype).removeprefix("torch."), list(p.shape)]
                           for name, p in params.items()}}

    def arctic_repack(self) -> int:
        """After the trainer wrote the weights in place: rebuild the packs the forward pass multiplies with
        (`cpu_weight_layout: packed`; nothing for plain weights)."""
        return repack(self.model_runner.get_model())

    def arctic_join_sync_group(self, host: str, port: int, timeout_s: float, nccl: bool) -> bool:
        """Join the trainer's two-member process group (trainer rank 0, this worker rank 1)."""
        self._arctic_group, self._arctic_store = join_group(host, port, 1, timeout_s, is_master=False, nccl=nccl)
        return True

    def arctic_receive_buckets(self) -> int:
        """Load buckets as they arrive (broadcast, or through shared memory) until the trainer's end marker."""
        # vLLM's layer-by-layer reload holds each layer's tensors until the layer is complete.
        buckets = receive_buckets(self._arctic_group, self, copy=not self._arctic_in_place())
        try:
            return self._arctic_reload(buckets)
        finally:
            buckets.close()  # after a failed load: drain the trainer's remaining buckets

    def _arctic_in_place(self) -> bool:
        return getattr(self.model_runner.get_model(), PLAIN_WEIGHTS, False)

    def _arctic_reload(self, weights) -> int:
        if not getattr(self, "_arctic_moe_prepack", False):
            prepack_experts_on_weight_updates(self.model_runner.get_model())
            self._arctic_moe_prepack = True
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        if self._arctic_in_place():
            self.model_runner.get_model().load_weights(counted())
            self.arctic_repack()
        else:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count


class RandomStateExtension:
    """The worker's generators, which vLLM's unseeded sampling draws from, for a checkpoint to keep."""

    def arctic_random_state(self) -> dict[str, bytes]:
        return random_state_bytes(process_random_state())

    def arctic_set_random_state(self, state: dict[str, bytes]) -> None:
        set_process_random_state(random_state_tensors(state))


class WorkerExtension(WeightSyncExtension, RoutedExpertsExtension, RandomStateExtension):
    """What vLLM's Worker gets from Arctic RL (`worker_extension_cls`): the weight sync's methods, R3's record, and
    the sampling generators' state."""
