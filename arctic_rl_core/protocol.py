"""The training API as routes: one table shared by the server and the client.

Each route names its request and response models and whether it is *ordered*
(training state: applied one at a time in arrival order, made idempotent by
request ids) or a *read* (may run while training runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.types import (
    CheckpointInfo,
    Completion,
    FwdBwdRequest,
    FwdBwdResult,
    GenerateRequest,
    LogProbsRequest,
    LogProbsResult,
    StepRequest,
    StepResult,
)

API_PREFIX = "/v1"
REQUEST_ID_HEADER = "X-Request-Id"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Empty(_Message):
    pass


class CheckpointRequest(_Message):
    path: str = Field(min_length=1)


class GenerateResponse(_Message):
    completions: list[Completion]


class WeightVersionResponse(_Message):
    weight_version: int


class DigestResponse(_Message):
    digest: str


@dataclass(frozen=True)
class Route:
    name: str
    request: type[BaseModel]
    response: type[BaseModel]
    ordered: bool
    call: Callable[[TrainingAPI, Any], BaseModel]


ROUTES: dict[str, Route] = {
    r.name: r
    for r in (
        Route("generate", GenerateRequest, GenerateResponse, False,
              lambda api, q: GenerateResponse(completions=api.generate(q.prompts, q.sampling))),
        Route("log_probs", LogProbsRequest, LogProbsResult, False,
              lambda api, q: api.log_probs(q.sequences, with_entropy=q.with_entropy, temperature=q.temperature,
                                           source=q.source)),
        Route("fwd_bwd", FwdBwdRequest, FwdBwdResult, True, lambda api, q: api.fwd_bwd(q.sequences, q.loss)),
        Route("discard_gradients", Empty, Empty, True, lambda api, q: api.discard_gradients() or Empty()),
        Route("step", StepRequest, StepResult, True, lambda api, q: api.step(q.learning_rate)),
        Route("sync_weights", Empty, WeightVersionResponse, True,
              lambda api, q: WeightVersionResponse(weight_version=api.sync_weights())),
        Route("save_checkpoint", CheckpointRequest, CheckpointInfo, True, lambda api, q: api.save_checkpoint(q.path)),
        Route("load_checkpoint", CheckpointRequest, CheckpointInfo, True, lambda api, q: api.load_checkpoint(q.path)),
        Route("state_digest", Empty, DigestResponse, True, lambda api, q: DigestResponse(digest=api.state_digest())),
        Route("weight_version", Empty, WeightVersionResponse, False,
              lambda api, q: WeightVersionResponse(weight_version=api.weight_version)),
    )
}
