"""Import-only stub of torchtitan.experiments.kernels.moe.indices (see torchtitan/__init__.py).

Imported at module import time by prime_rl.trainer.models.layers.mxfp8_grouped_gemm
(`from torchtitan.experiments.kernels.moe import indices as tt_indices`).
"""


def generate_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, max_len, alignment, use_cpu=False):
    raise NotImplementedError(
        "torchtitan generate_permute_indices: torchtitan is an import-only stub in this environment"
    )
