"""A completion's routing record (router replay's R3) on a route's choice: as `vllm serve` sends it on the OpenAI
routes, and as prime-rl's and SkyRL's inference servers send it on the token routes."""

from __future__ import annotations

import base64
import io

import numpy as np

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Completion


def check_routes_start(start: int | None, prompt: list[int], field_: str) -> None:
    if start is not None and not 0 <= start <= len(prompt):
        raise InvalidRequest(field_, f"is {start}; it must be within the prompt (0 to {len(prompt)})")


def routes_as_vllm(c: Completion, start: int | None) -> dict:
    """An OpenAI route's choice's `routed_experts` as `vllm serve` sends it: base64 of the `[tokens, layers, top_k]`
    array's `.npy` bytes (`np.load(io.BytesIO(base64.b64decode(s)))`), uint8 up to 256 experts, else uint16."""
    if c.routed_experts is None:
        return {}
    routes = c.routed_experts.array()[start or 0:]
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if routes.size == 0 or routes.max() < 2**8 else np.uint16),
            allow_pickle=False)
    return {"routed_experts": base64.b64encode(buffer.getbuffer()).decode("ascii")}


def routes_packed(c: Completion, start: int | None) -> dict:
    """A token route's choice's `routed_experts` (vLLM's key) as prime-rl's and SkyRL's servers send it, where the
    sampler recorded them (router replay's R3)."""
    return {} if c.routed_experts is None else {"routed_experts": _routed_experts(c, start or 0)}


def _routed_experts(c: Completion, start: int) -> dict:
    """A completion's routing (R3) as prime-rl's and SkyRL's inference servers return it on a choice, which their
    clients read: `[tokens, layers, top_k]` from `start` (`routed_experts_prompt_start`) to the last forwarded token,
    raw in base64, in the narrowest type that holds the ids (uint8, int16, int32: SkyRL refuses any other), `data`
    first (SkyRL's client finds it by scanning the compact JSON). vLLM's own `.npy` string is not sent."""
    routes = c.routed_experts.array()[start:]
    top = int(routes.max()) if routes.size else 0
    compact = routes.astype(np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32)
    return {"data": base64.b64encode(np.ascontiguousarray(compact).tobytes()).decode("ascii"),
            "shape": list(compact.shape), "start": start, "dtype": compact.dtype.name}
