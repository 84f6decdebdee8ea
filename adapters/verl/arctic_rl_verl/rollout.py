"""verl's rollout `arctic_rl`: generation on Arctic RL's sampler, weight sync inside the backend.

Three pieces, all selected by `actor_rollout_ref.rollout.name=arctic_rl`:
- `ArcticReplica` (verl's `RolloutReplicaRegistry`): starts one `ArcticServer` actor.
- `ArcticServer` (a Ray actor): verl's agent loop sends it one request per sample; requests that
  arrive together are batched into one `generate` call, so vLLM prefills each shared prompt once.
- `ArcticRolloutAdapter` (the hybrid worker's rollout): verl calls its `update_weights` after every
  step; it asks the backend to `sync_weights` (the trainer's weights never travel through verl).

The server address comes from `actor_rollout_ref.rollout.custom.arctic` (the adapter's
`arctic_ppo_trainer` config points it at `actor_rollout_ref.actor.arctic`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import ray
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from arctic_rl_core.client import ArcticRLClient, AsyncArcticRLClient
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import SamplingParams
from arctic_rl_verl import trace
from arctic_rl_verl.connect import URL_KEY, ArcticSetupError, client_for

logger = logging.getLogger(__name__)
SERVER_PREFIX = "arctic_rl_server_"
BATCH_WINDOW_S = 0.005
"""Requests are sent once none has arrived for this long (verl's agent loop sends a step's requests in a
burst), in one `generate` call, group by group: a prompt with fewer copies than the group size (rollout.n)
waits for the rest, so a GRPO group is never split between calls and its prompt is prefilled once..."""
MAX_BATCH_WAIT_S = 1.0
"""...except that a request waits at most this long (validation may sample another n)."""


@dataclass
class RolloutSettings:
    url: str
    token_env: str = "ARCTIC_RL_TOKEN"
    timeout_s: float = 600.0

    @classmethod
    def from_rollout_config(cls, config) -> "RolloutSettings":
        custom = dict(config.custom or {})
        arctic = dict(custom.get("arctic") or {})
        if not arctic.get("url"):
            raise ArcticSetupError(f"actor_rollout_ref.rollout.custom.arctic.url is not set (the arctic_ppo_trainer "
                                   f"config takes it from {URL_KEY})")
        return cls(url=arctic["url"], token_env=arctic.get("token_env", cls.token_env),
                   timeout_s=float(arctic.get("timeout_s", cls.timeout_s)))

    def client(self) -> ArcticRLClient:
        return client_for(self.url, self.token_env, self.timeout_s)

    def async_client(self) -> AsyncArcticRLClient:
        return AsyncArcticRLClient(self.url, token=os.environ.get(self.token_env), timeout_s=self.timeout_s)


def _prompt_index(field: str) -> int | None:
    """`prompts[3]` -> 3: which prompt of a generate call the backend refused."""
    match = re.fullmatch(r"prompts\[(\d+)\]", field or "")
    return int(match.group(1)) if match else None


def check_context(client: ArcticRLClient, prompt_length: int, response_length: int) -> None:
    """The longest prompt verl may send plus the response it asks for must fit the served context."""
    context = client.status()["backend"]["max_context"]
    if prompt_length + response_length > context:
        raise ArcticSetupError(f"data.max_prompt_length + data.max_response_length = {prompt_length} + {response_length} "
                               f"exceed the Arctic RL sampler's context of {context} tokens (its sampler.max_model_len, "
                               "or the model's max_position_embeddings): lower them or serve a longer context")


def to_sampling_params(params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """verl's per-request sampling dict as Arctic RL's `SamplingParams` (one sample per request)."""
    top_k = int(params.get("top_k", -1))
    shaping = {name: float(params[name]) for name in ("repetition_penalty", "presence_penalty", "frequency_penalty",
                                                      "min_p") if params.get(name) is not None}
    return SamplingParams(
        n=1, temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
        top_k=max(top_k, 0), max_tokens=int(params.get("max_tokens") or params.get("max_new_tokens") or default_max_tokens),
        stop_token_ids=list(params.get("stop_token_ids") or []), seed=params.get("seed"), **shaping,
    )


class ArcticServer:
    """The handle verl's agent loop sends `generate` requests to."""

    def __init__(self, config, replica_rank: int):
        self.settings = RolloutSettings.from_rollout_config(config)
        self._client: Optional[AsyncArcticRLClient] = None
        """Made in the actor's event loop on first use (an asyncio client belongs to one loop)."""
        self.response_length = config.response_length
        self.replica_rank = replica_rank
        self._pending: dict[str, list[tuple[list[int], asyncio.Future, float]]] = {}
        """Per sampling settings: (prompt, its future, when it arrived)."""
        self._flush: Optional[asyncio.Task] = None
        self._arrivals = 0
        self.group_size = int(config.n)
        """verl's rollout.n: the samples of one prompt, sent as that many requests."""
        self.global_steps: Optional[int] = None
        """verl's step whose weights the sampler holds (verl tracks sample staleness by it)."""
        self.step_of_version: dict[int, Optional[int]] = {}
        """verl's step of each weight version synced through verl: a sample reports the step of its oldest token's
        weights, so verl's staleness bound counts a sample that a sync crossed (one call, no abort) from its start."""
        self.routing_replay = bool(getattr(config, "enable_rollout_routing_replay", False))
        """verl's R3: each sample returns the experts the job's sampler routed its tokens to."""

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       **kwargs) -> TokenOutput:
        if image_data or video_data:
            raise ValueError("arctic_rl serves text-only rollouts")
        params = to_sampling_params(dict(sampling_params), self.response_length)
        future = asyncio.get_running_loop().create_future()
        arrived = time.time()
        self._pending.setdefault(params.model_dump_json(), []).append((list(prompt_ids), future, arrived))
        self._arrivals += 1
        if self._flush is None:
            self._flush = asyncio.create_task(self._send_batches())
        completion = await future
        routes = None
        if self.routing_replay:
            if completion.routed_experts is None and completion.token_ids:
                raise ValueError("actor_rollout_ref.rollout.enable_rollout_routing_replay=True, but the Arctic RL job "
                                 "records no routes: start it with router_replay: R3 and a sampler that records them")
            routes = None if completion.routed_experts is None else completion.routed_experts.array()
        steps = self.step_of_version.get(completion.weight_version, self.global_steps)
        return TokenOutput(token_ids=completion.token_ids, log_probs=completion.logprobs, stop_reason="completed",
                           routed_experts=routes, extra_fields={"global_steps": steps,
                                                                "arctic_weight_version": completion.weight_version})

    async def _send_batches(self):
        started = time.time()
        while True:  # until no request arrived for a window (or requests never stop coming)
            seen = self._arrivals
            await asyncio.sleep(BATCH_WINDOW_S)
            if self._arrivals == seen or time.time() - started >= MAX_BATCH_WAIT_S:
                break
        now = time.time()
        pending, self._pending, self._flush = self._pending, {}, None
        ready: dict[str, list] = {}
        for key, requests in pending.items():
            copies = Counter(tuple(prompt) for prompt, _, _ in requests)
            for request in requests:
                whole = copies[tuple(request[0])] % self.group_size == 0
                target = ready if whole or now - request[2] >= MAX_BATCH_WAIT_S else self._pending
                target.setdefault(key, []).append(request)
        if self._pending:  # groups still arriving
            self._flush = asyncio.create_task(self._send_batches())
        for key, requests in ready.items():
            await self._generate(requests, SamplingParams.model_validate_json(key))

    @property
    def client(self) -> AsyncArcticRLClient:
        if self._client is None:
            self._client = self.settings.async_client()
        return self._client

    async def _generate(self, requests: list, params: SamplingParams) -> None:
        """One `generate` call for `requests`. A prompt the backend refuses (longer than its context, say) fails
        alone, with the backend's reason, and the others are sent again without it."""
        while requests:
            call_start = time.time()
            try:
                completions = await self.client.generate([p for p, _, _ in requests], params)
            except InvalidRequest as err:
                bad = _prompt_index(err.field)
                if bad is not None and bad < len(requests):
                    prompt, future, _ = requests.pop(bad)
                    future.set_exception(ValueError(f"arctic_rl refused a prompt of {len(prompt)} tokens: {err.message}"))
                    continue
                for _, future, _ in requests:
                    future.set_exception(err)
                return
            except Exception as err:  # every waiting request sees the backend's error
                for _, future, _ in requests:
                    future.set_exception(err)
                return
            call_end = time.time()
            for completion in completions:
                requests[completion.prompt_index][1].set_result(completion)
            trace.record("generate", global_steps=self.global_steps, requests=len(requests),
                         first_arrival=min(arrived for _, _, arrived in requests), call_start=call_start,
                         call_end=call_end, answered=time.time())
            return

    async def set_global_steps(self, global_steps: int, weight_version: Optional[int] = None):
        self.global_steps = global_steps
        if weight_version is not None:
            self.step_of_version[weight_version] = global_steps

    # verl's control plane: memory and scheduling are the backend's business.
    async def wake_up(self, tags=None):
        pass

    async def sleep(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def abort_all_requests(self, reject_request: bool = False, **kwargs):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class ArcticReplica(RolloutReplica):
    async def launch_servers(self):
        name = f"{SERVER_PREFIX}{self.replica_rank}{self.name_suffix}"
        server = (ray.remote(ArcticServer)
                  .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
                  .remote(config=self.config, replica_rank=self.replica_rank))
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"arctic-rl://{name}"  # the load balancer's key


class ArcticRolloutAdapter(BaseRollout):
    """The rollout object inside verl's hybrid worker; only weight sync reaches it."""

    def __init__(self, config, model_config, device_mesh=None, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.client = RolloutSettings.from_rollout_config(config).client()
        check_context(self.client, int(self.config.prompt_length), int(self.config.response_length))

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, **kwargs):
        leftover = sum(1 for _ in weights)  # the engine hands over none: the weights stay in the backend
        if leftover:
            raise RuntimeError(f"arctic_rl's rollout got {leftover} tensors from a non-arctic_rl training engine")
        version = await asyncio.to_thread(self.client.sync_weights)
        steps = kwargs.get("global_steps")
        for name in ray.util.list_named_actors():
            if name.startswith(SERVER_PREFIX):
                await ray.get_actor(name).set_global_steps.remote(steps, version)
        logger.info("arctic_rl: backend weights synced into the sampler (weight_version %d, global step %s)",
                    version, steps)

