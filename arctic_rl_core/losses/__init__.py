"""Loss functions and post-processors, and their registries."""

from arctic_rl_core.losses import grpo, importance_sampling, post_processors, sft  # noqa: F401  (registers built-ins)
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.registry import LOSSES, POST_PROCESSORS, register_loss_fn, register_post_processor

__all__ = ["LOSSES", "POST_PROCESSORS", "LossInputs", "register_loss_fn", "register_post_processor"]
