"""Forest cascade attention as a vLLM attention backend: vLLM's Triton backend, except that a decoding step
whose sequences share leading KV-cache blocks runs `cascade_decode`, which reads each shared block once for all
of its readers instead of once per sequence.

With prefix caching (the sampler always enables it) the samples of one prompt (GRPO's G) and the turns of one
episode point their block tables at the same physical blocks; `DecodeForest.from_block_tables` finds them.
Everything else (prefills, mixed batches, steps that share nothing, layers with windows, softcaps, ALiBi,
sinks or a quantized cache) runs vLLM's own Triton attention, unchanged. Both are exact attention: only the
order of the sums differs.

vLLM imports this module by the class path `vllm_forest_cascade` registers; that must come first, because
on CPU it makes vLLM's Triton kernels importable (under the interpreter).
"""

from __future__ import annotations

from collections import Counter

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from arctic_rl_kernels.cascade_decode import DecodeForest, cascade_decode

SERVED = Counter()
"""This process's decoding steps: `cascade` (a forest found), `plain` (nothing shared), and layer calls
`cascade_layers`. Read through the worker extension (`VLLMSampler.forest_cascade_served`)."""


def decode_forest(block_table: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, block_size: int) -> DecodeForest | None:
    """The forest of one decoding step's KV caches, or None when no two sequences share a block."""
    if num_reqs < 2:
        return None
    lens = seq_lens[:num_reqs].tolist()
    if min(lens) < 1:  # a row without keys (a dummy run's): vLLM's own
        return None
    tables = block_table[:num_reqs, : -(-max(lens) // block_size)].cpu()  # one copy to the host per step
    if len(set(tables[:, 0].tolist())) == num_reqs:  # no two sequences start in the same block: nothing is shared
        return None
    try:
        forest = DecodeForest.from_block_tables(tables, lens, block_size)
    except ValueError:  # a shared block filled to different lengths: never expected, and never fatal to the engine
        return None
    return forest if len(forest.segments) > num_reqs else None


class ForestCascadeMetadataBuilder(TritonAttentionMetadataBuilder):
    # The cascade's work items depend on the step's forest: decided in Python, so never inside a CUDA graph
    # (vLLM then captures the rest of the model piecewise and runs attention eagerly).
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_draft_decode_metadata_update = False

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        forest = None
        if cm.max_query_len == 1 and cm.causal is True:  # a tensor there is per-request masking (speculative)
            forest = decode_forest(cm.block_table_tensor, cm.seq_lens, cm.num_reqs, self.block_size)
            SERVED["cascade" if forest is not None else "plain"] += 1
        meta.forest = forest  # set on a pure decoding step whose sequences share cache blocks, else None
        return meta


class ForestCascadeImpl(TritonAttentionImpl):
    def _cascade_serves(self) -> bool:
        return (self.alibi_slopes is None and self.sliding_window == (-1, -1) and not self.logits_soft_cap
                and self.sinks is None and self.kv_cache_dtype == "auto" and self.chunk_lookback == -1)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        forest = getattr(attn_metadata, "forest", None)
        if (forest is None or output_scale is not None or output_block_scale is not None or not self._cascade_serves()
                or attn_metadata.rswa_window is not None):  # a window on generated tokens (R-SWA)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        # Logical [blocks, kv heads, block size, 2 * head size]; in the pinned LBNHC layout blocks and their
        # slots are one run of rows, so a cache row is block * block_size + slot, as the forest's key_rows say.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        blocks, block_size = key_cache.shape[:2]
        if key_cache.stride(0) != block_size * key_cache.stride(1):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        rows = lambda cache: cache.flatten(0, 1).transpose(0, 1)  # [kv heads, blocks * block size, head size]
        n = forest.num_sequences
        out = cascade_decode(query[:n], rows(key_cache), rows(value_cache), forest, self.scale)
        output[:n] = out.reshape(output[:n].shape)
        SERVED["cascade_layers"] += 1
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if kv_cache.is_cuda:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # vLLM's Triton cache write asks CUDA for the device's capability: on CPU, the same write by indexing.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        live = slots >= 0  # padded tokens have slot -1
        block, slot = slots[live] // key_cache.shape[1], slots[live] % key_cache.shape[1]
        key_cache[block, slot] = key[:n][live].to(key_cache.dtype)
        value_cache[block, slot] = value[:n][live].to(value_cache.dtype)


class ForestCascadeBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry's member for an out-of-tree backend (vllm_forest_cascade registers it)

    @staticmethod
    def get_impl_cls():
        return ForestCascadeImpl

    @staticmethod
    def get_builder_cls():
        return ForestCascadeMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC,)
