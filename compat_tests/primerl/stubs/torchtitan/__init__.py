"""Import-only stub of torchtitan for a CPU-only prime-rl compatibility environment.

prime-rl 0.8.0 (559b447) pins torchtitan to git rev 23e4dfc (github.com/pytorch/torchtitan),
which is not on PyPI; the PyPI releases (0.2.2, 0.3.0) lack
`torchtitan.distributed.expert_parallel.expert_parallel`/`set_token_group_alignment_size_m`
and `torchtitan.experiments.kernels.moe.indices`.  prime-rl imports these names at import
time of `prime_rl.trainer.model` (pulled in by `prime_rl.orchestrator.orchestrator` for
`setup_tokenizer`).  Nothing here is used by the orchestrator, the rollout/weight transports
or the loss; every callable raises if it is actually used (expert-parallel MoE training only).
"""

__version__ = "0.0.0+primerl.importstub"
STUB = True
