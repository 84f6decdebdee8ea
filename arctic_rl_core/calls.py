"""The training API's calls, as one table.

Each call names its request and response models, whether it is *ordered*
(training state: applied one at a time in arrival order, made idempotent by
request ids) or a *read* (may run while training runs), and which response
field carries the method's return value. `TrainingAPI` gives each call its
typed signature, whose parameters are the request's fields; the HTTP routes,
the blocking and asyncio clients and the futures all derive from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.types import (
    CheckpointInfo,
    Completion,
    Episode,
    EpisodeRequest,
    FwdBwdRequest,
    FwdBwdResult,
    GenerateRequest,
    LogProbsRequest,
    LogProbsResult,
    RoleRequest,
    StepRequest,
    StepResult,
    ValuesRequest,
    ValuesResult,
)

API_PREFIX = "/v1"
REQUEST_ID_HEADER = "X-Request-Id"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Empty(_Message):
    pass


class CheckpointRequest(_Message):
    path: str = Field(min_length=1)


class LoadCheckpointRequest(CheckpointRequest):
    optimizer: bool = True
    """False: the weights only, with a fresh optimizer."""


class GenerateResponse(_Message):
    completions: list[Completion]


class WeightVersionResponse(_Message):
    weight_version: int


class DigestResponse(_Message):
    digest: str


@dataclass(frozen=True)
class Call:
    name: str
    request: type[BaseModel]
    response: type[BaseModel]
    ordered: bool
    returns: str | None = None
    """The response field that is the method's return value; None: the response itself (or nothing, if Empty)."""
    attribute: bool = False
    """A property of the API (`api.weight_version`) rather than a method."""

    @property
    def path(self) -> str:
        return f"{API_PREFIX}/{self.name}"

    def invoke(self, api: Any, request: BaseModel) -> BaseModel:
        """Run this call on an API object with a parsed request; the response model."""
        if self.attribute:
            value = getattr(api, self.name)
        else:
            value = getattr(api, self.name)(**{name: getattr(request, name) for name in type(request).model_fields})
        return self.response_of(value)

    def response_of(self, value: Any) -> BaseModel:
        if self.returns is not None:
            return self.response(**{self.returns: value})
        return self.response() if self.response is Empty else value

    def value_of(self, response: BaseModel) -> Any:
        """The method's return value from its response model."""
        if self.returns is not None:
            return getattr(response, self.returns)
        return None if self.response is Empty else response


CALLS: dict[str, Call] = {
    c.name: c
    for c in (
        Call("generate", GenerateRequest, GenerateResponse, ordered=False, returns="completions"),
        Call("episode", EpisodeRequest, Episode, ordered=False),
        Call("log_probs", LogProbsRequest, LogProbsResult, ordered=False),
        Call("values", ValuesRequest, ValuesResult, ordered=False),
        Call("fwd_bwd", FwdBwdRequest, FwdBwdResult, ordered=True),
        Call("discard_gradients", RoleRequest, Empty, ordered=True),
        Call("step", StepRequest, StepResult, ordered=True),
        Call("sync_weights", Empty, WeightVersionResponse, ordered=True, returns="weight_version"),
        Call("save_checkpoint", CheckpointRequest, CheckpointInfo, ordered=True),
        Call("load_checkpoint", LoadCheckpointRequest, CheckpointInfo, ordered=True),
        Call("state_digest", Empty, DigestResponse, ordered=True, returns="digest"),
        Call("weight_version", Empty, WeightVersionResponse, ordered=False, returns="weight_version", attribute=True),
    )
}
