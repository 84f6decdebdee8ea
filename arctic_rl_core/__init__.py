"""Arctic RL core: the training API, its in-process backend, engines, samplers and losses."""

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.errors import ArcticRLError, InvalidRequest, UnknownName
from arctic_rl_core.losses.registry import register_loss_fn, register_post_processor
from arctic_rl_core.types import (
    CheckpointInfo,
    Completion,
    FwdBwdResult,
    LogProbsResult,
    LossSpec,
    ProcessorSpec,
    SamplingParams,
    Sequence,
    StepResult,
)

__version__ = "0.1.0"

__all__ = [
    "ArcticRLError", "CheckpointInfo", "Completion", "FwdBwdResult", "InvalidRequest", "LogProbsResult", "LossSpec",
    "ProcessorSpec", "SamplingParams", "Sequence", "StepResult", "TrainingAPI", "UnknownName",
    "register_loss_fn", "register_post_processor",
]
