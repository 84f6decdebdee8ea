"""Tinker's training and sampling API (`/api/v1/...`) on `arctic-rl serve`, for the unmodified `tinker` SDK.

A Tinker model trains as the job's policy does (LoRA at the job's `engine.lora` rank, or all parameters where the
server runs with `--tinker-full-parameter`), each from the base model, several time-sharing the engine
(`tenants.py`). Each request is a tenant's, and sees only that tenant's sessions, models and results. Training
calls run on the job's ordered worker in `seq_id` order; `forward_backward` accumulates gradients until
`optim_step`, as Tinker's do. `save_weights_for_sampler` keeps the model's weights for the sampler: an adapter it
serves, or a snapshot it loads when sampled (`snapshots.py`); a sampling session samples those weights and no
others, until they are deleted or evicted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from arctic_rl_core.batching import batch_loss_inputs
from arctic_rl_core.errors import InvalidRequest, NotFound
from arctic_rl_core.models.lora_shape import FAMILIES, AdapterShape
from arctic_rl_core.plugins.manager import load_plugins
from arctic_rl_core.server.limits import OverLimit, RequestLimits
from arctic_rl_core.server.security import TINKER_PREFIX, confine
from arctic_rl_core.tinker import rest, wire
from arctic_rl_core.tinker.futures import FutureTable, SeqOrder
from arctic_rl_core.tinker.losses import loss_spec, with_loss_inputs
from arctic_rl_core.tinker.snapshots import BASE, SamplerHold
from arctic_rl_core.tinker.tenants import JOB, Residency, tenant_of
from arctic_rl_core.types import MAX_LEARNING_RATE, MAX_TOP_LOGPROBS, AdamSettings, LossSpec, SamplingParams, Sequence
from arctic_rl_core.validation import parse

PREFIX = TINKER_PREFIX.rstrip("/")
MAX_SESSIONS = 1024
SESSIONS_PER_TENANT = 64
"""A tenant's sessions past this push out its own least recently heard from (one that holds no model)."""
SAMPLERS_PER_TENANT = 256
"""A tenant's sampling sessions past this push out its own oldest (an RL loop makes one per step)."""
KEPT_PER_MODEL = 4
"""Sampler saves (adapters or snapshots) kept per model the server trains at once: an RL loop saves one per step and
samples the newest."""
SHAPE_FILE = "tinker_adapter.json"
"""In a Tinker checkpoint of a LoRA job: the rank and module families its model trained."""
SESSION_TIMEOUT_S = 60.0
"""A session not heard from for this long (the SDK heartbeats every 10 s) no longer holds its models."""
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TINKER_PATH = re.compile(r"^tinker://(?P<model>[0-9a-f]+:train:[0-9]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/]+)$")
# Arctic RL field names in a backend refusal, as the Tinker request spells them.
_FIELD_NAMES = {"advantages": "loss_fn_inputs.advantages", "behaviour_logprobs": "loss_fn_inputs.logprobs",
                "prompt_ids": "model_input", "response_ids": "model_input"}


ADAM_PARAMS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
               "grad_clip_norm": 0.0}
"""Tinker's `AdamParams` and their defaults (SDK 0.38), which a field the request leaves out takes."""


@dataclass
class TinkerModel:
    model_id: str
    session_id: str
    tenant: str
    shape: AdapterShape | None = None
    """The part of the job's adapter it trains (`lora_config`); None: all of it, or all parameters."""
    order: SeqOrder = field(default_factory=SeqOrder)


@dataclass
class Session:
    tenant: str
    seen: float
    """When it was last heard from."""
    user_metadata: dict | None = None


@dataclass
class SamplerWeights:
    """What a sampling session samples: `kept`, what a `save_weights_for_sampler` kept (an adapter the sampler serves
    on its base model, or a snapshot of the model's weights), or None: the base model."""
    tenant: str
    kept: str | None = None
    shape: AdapterShape | None = None
    """The adapter shape of the model that saved them."""
    saved: float = field(default_factory=time.time)


@dataclass
class Kept:
    """Weights a save kept for the sampler: an adapter it serves, or a snapshot it loads when sampled."""
    model_id: str
    folder: str
    adapter: bool


@dataclass
class Sampler:
    session_id: str
    weights: SamplerWeights
    model_path: str | None


@dataclass
class TinkerState:
    full_parameter: bool = False
    """Train all of a full-parameter job's weights for a client that asks for LoRA (the SDK can ask for no other)."""
    max_models: int = 8
    """Models training at once, time-sharing the engine, each from the base model."""
    keys: dict[str, str] | None = None
    """Tenant name -> API key; None: any key, each its own tenant."""
    sessions: dict[str, Session] = field(default_factory=dict)
    models: dict[str, TinkerModel] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    sampler_paths: dict[str, SamplerWeights] = field(default_factory=dict)
    """tinker://.../sampler_weights/<name> -> what was saved under it."""
    kept: dict[str, Kept] = field(default_factory=dict)
    """What saves kept for the sampler, oldest first, by name."""
    uses: Counter = field(default_factory=Counter)
    """Samples in flight (or waiting for the sampler) per kept name (on the event loop only)."""
    retired: dict[str, Kept] = field(default_factory=dict)
    """Kept weights no longer sampled by new samples, dropped once their samples in flight end."""
    hold: SamplerHold = field(default_factory=SamplerHold)
    """Which snapshot the sampler holds, where it serves no adapters."""
    base_folder: str | None = None
    """Where the base model's snapshot is kept, where the sampler serves no adapters (written before the first model
    trains, where the sampler still holds the base weights then)."""
    futures: FutureTable = field(default_factory=FutureTable)
    downloads: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Signed download tokens of external weights: token -> (folder, when it expires)."""


def _translated(err: InvalidRequest) -> InvalidRequest:
    """A backend refusal about `sequences[i].<field>` named as the Tinker request's `data[i].<key>`."""
    match = re.match(r"^sequences\[(\d+)\]\.?(\w*)(.*)$", err.field or "")
    if not match:
        return err
    key = _FIELD_NAMES.get(match.group(2), match.group(2))
    return type(err)(f"data[{match.group(1)}]" + (f".{key}" if key else "") + match.group(3), err.message)


def _failure(err: Exception) -> dict:
    category = "user" if isinstance(err, InvalidRequest) else "server"
    message = f"{err.field}: {err.message}" if isinstance(err, InvalidRequest) else f"{type(err).__name__}: {err}"
    return {"error": message, "category": category}


def add_tinker_routes(app: FastAPI, state: TinkerState, job, api_of: Callable[[], Any], serving,
                      read_json: Callable[[Request], Awaitable[Any]], read_bytes: Callable[[Request], Awaitable[bytes]],
                      limits: RequestLimits, checkpoint_root: str) -> None:
    losses = load_plugins().losses

    def model_name(api) -> str:
        return serving.model_name(api)

    residency = Residency(os.path.join(checkpoint_root, "tinker", ".parked"))
    job.own_policy = lambda: residency.enter(job.api, JOB)
    kept_ids = itertools.count(1)

    def tenant(request: Request) -> str:
        return tenant_of(request, state.keys)

    def session(session_id: Any, who: str) -> str:
        found = state.sessions.get(session_id) if isinstance(session_id, str) else None
        if found is None or found.tenant != who:
            raise NotFound("session_id", f"no session {session_id!r} on this server: create_session first")
        found.seen = time.time()
        return session_id

    def owned_model(model_id: Any, who: str) -> TinkerModel:
        model = state.models.get(model_id) if isinstance(model_id, str) else None
        if model is None or model.tenant != who:
            raise NotFound("model_id", f"no model {model_id!r} on this server")
        session(model.session_id, who)
        return model

    def resolve(outcome: asyncio.Future, done: asyncio.Future, settle: Callable[[Any], Any] | None = None) -> None:
        """`outcome` takes `done`'s result (through `settle`, on the event loop, once) or its failure."""
        try:
            result = done.result()
            outcome.set_result(settle(result) if settle is not None else result)
        except Exception as err:  # the call's failure, or settle's, is the future's answer
            outcome.set_exception(err)

    def enter(model: TinkerModel) -> None:
        """On the ordered worker: the engine holds `model`'s training state."""
        api = api_of()
        if residency.untrained is None and not serves_adapters(api):  # the first model: keep the base's weights
            keep_base(api)
        residency.enter(api, model.model_id, model.shape)

    def deferred(model: TinkerModel, encode: Callable[[Any], Any], work: Callable[[], Any],
                 settle: Callable[[Any], Any] | None = None) -> tuple[str, Callable[[], None]]:
        """A request id now, and `start()`, which runs `work` on `model`'s training state on the job's ordered
        worker; its result is encoded when retrieved."""
        request_id, outcome = state.futures.add(encode, model.tenant)

        def on_model():
            enter(model)
            return work()

        def start():
            running = asyncio.wrap_future(job.ordered.submit(on_model))
            running.add_done_callback(lambda done: resolve(outcome, done, settle))
        return request_id, start

    def ordered(model: TinkerModel, seq_id: Any, encode, work, settle: Callable[[Any], Any] | None = None) -> dict:
        """A training call in its seq_id turn on the job's ordered worker; the same seq_id sent again is one call.
        `settle(result)` records what the call changed in the routes' state, on the event loop."""
        if not isinstance(seq_id, int):
            raise InvalidRequest("seq_id", "must be an integer")
        if seq_id in model.order.issued:
            return {"request_id": model.order.issued[seq_id], "model_id": model.model_id}
        request_id, start = deferred(model, encode, work, settle)
        model.order.admit(seq_id, start)
        model.order.issued[seq_id] = request_id
        return {"request_id": request_id, "model_id": model.model_id}

    @contextmanager
    def in_turn(model_id: Any, seq_id: Any, who: str):
        """A training call's checks: where they refuse it, its seq_id's turn passes (the SDK numbered the calls after
        it already, and they must not wait for one that never runs)."""
        try:
            yield
        except InvalidRequest:
            model = state.models.get(model_id) if isinstance(model_id, str) else None
            if model is not None and model.tenant == who:
                model.order.skip(seq_id)
            raise

    def training_call(name: str):
        """A JSON route of a training call: `handler(body, tenant)` checks it and returns its future (`ordered`)."""
        def register(handler: Callable[[dict, str], dict]) -> Callable[[dict, str], dict]:
            async def route(request: Request):
                who = tenant(request)
                body = await read_json(request)
                with in_turn(body.get("model_id"), body.get("seq_id"), who):
                    return handler(body, who)
            app.post(f"{PREFIX}/{name}", name=f"tinker_{name}")(route)
            return handler
        return register

    def run_folder(who: str, model_id: str) -> str:
        return confine(checkpoint_root, os.path.join("tinker", who, model_id.replace(":", "_")))

    def checkpoint_dir(who: str, model_id: str, name: Any, kind: str = "weights") -> str:
        """A tenant's checkpoints (`weights`) and adapters for the sampler (`sampler_weights`) lie under its own
        folder: a path of another's names nothing there."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest("path", f"{name!r} is not a checkpoint name (1-128 of A-Z a-z 0-9 . _ -)")
        return confine(checkpoint_root, os.path.join("tinker", who, model_id.replace(":", "_"), kind, name))

    # -- session ------------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/client/config")
    async def client_config(request: Request):
        await read_json(request)
        # Plain httpx (no pyqwest); uncompressed forward_backward bodies; one poll per future.
        return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": False, "pjwt_auth_enabled": False,
                "sample_use_retrieve_futures": False, "parallel_fwdbwd_chunks": True}

    @app.post(f"{PREFIX}/client/dynamic_config")
    async def dynamic_config(request: Request):
        await read_json(request)
        return {}

    @app.post(f"{PREFIX}/create_session")
    async def create_session(request: Request):
        who = tenant(request)
        body = await read_json(request)
        own = [s for s in sorted(state.sessions, key=lambda s: state.sessions[s].seen)
               if state.sessions[s].tenant == who]
        if len(own) >= SESSIONS_PER_TENANT:
            holding = {m.session_id for m in state.models.values()}
            idle = [s for s in own if s not in holding]
            if not idle:
                raise OverLimit("session", f"this tenant holds {SESSIONS_PER_TENANT} sessions, each with a model")
            forget_session(idle[0])
        if len(state.sessions) >= MAX_SESSIONS:
            raise OverLimit("session", f"the server holds {MAX_SESSIONS} sessions")
        session_id = uuid.uuid4().hex
        metadata = body.get("user_metadata") if isinstance(body, dict) else None
        state.sessions[session_id] = Session(who, time.time(), metadata if isinstance(metadata, dict) else None)
        return {"session_id": session_id, "type": "create_session"}

    @app.post(f"{PREFIX}/session_heartbeat")
    async def heartbeat(request: Request):
        who = tenant(request)
        body = await read_json(request)
        try:
            session(body.get("session_id"), who)
        except NotFound:
            return JSONResponse({"error": "unknown session"}, status_code=410)  # the SDK stops its heartbeat
        return {"type": "session_heartbeat"}

    @app.post(f"{PREFIX}/telemetry")
    async def telemetry(request: Request):
        await read_json(request)
        return {"status": "accepted"}  # kept nowhere: the server sends nothing out

    @app.post(f"{PREFIX}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, request: Request):
        who = tenant(request)
        await read_json(request)
        session(session_id, who)
        for model in [m for m in state.models.values() if m.session_id == session_id]:
            await asyncio.wrap_future(release(job.api, model))
        forget_session(session_id)
        return {}

    def forget_session(session_id: str) -> None:
        """The session goes with its sampling sessions (its models are released first)."""
        for key in [k for k, s in state.samplers.items() if s.session_id == session_id]:
            del state.samplers[key]
        del state.sessions[session_id]

    @app.get(f"{PREFIX}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get(f"{PREFIX}/get_server_capabilities")
    async def capabilities():
        api = api_of()
        return {"supported_models": [{"model_name": model_name(api), "max_context_length": api.sampler.max_context,
                                      "trainable": True, "sampleable": True}]}

    # -- models -------------------------------------------------------------------------------------------

    def release(api, model: TinkerModel):
        """The model leaves, with its training state and the gradients it never stepped (on the ordered worker,
        before any call of the next model)."""
        del state.models[model.model_id]
        return job.ordered.submit(residency.leave, api, model.model_id, not state.models)

    def lora_rank(api, shape: AdapterShape | None) -> int | None:
        layout = api.adapter_layout()
        return None if layout is None else layout.rank if shape is None else shape.rank

    def saved_shape(api, directory: str) -> AdapterShape | None:
        """The adapter shape of the model that saved the checkpoint in `directory` (None: the whole adapter)."""
        layout = api.adapter_layout()
        try:
            with open(os.path.join(directory, SHAPE_FILE)) as f:
                saved = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise InvalidRequest("path", f"the checkpoint's {SHAPE_FILE} cannot be read: {err}") from None
        if layout is None:
            raise InvalidRequest("path", "the checkpoint holds a LoRA adapter; this job trains all parameters")
        return lora_shape(api, saved, "path")

    def lora_shape(api, config: Any, field_name: str = "lora_config") -> AdapterShape | None:
        """The part of the job's adapter a model trains, from its `lora_config` (None: all of it)."""
        config = config or {}
        if not isinstance(config, dict):
            raise InvalidRequest(field_name, "must be an object")
        layout = api.adapter_layout()
        if layout is None:
            if config.get("rank") is not None and not state.full_parameter:
                raise InvalidRequest(f"{field_name}.rank", "this job trains all parameters, not LoRA adapters; start "
                                     "the server with --tinker-full-parameter to train them for a LoRA client")
            return None
        if config.get("seed") is not None and config["seed"] != api.config.engine.seed:
            raise InvalidRequest(f"{field_name}.seed", f"adapters start from the job's initialization (engine.seed "
                                 f"{api.config.engine.seed}), not a seed of their own")
        rank = config.get("rank", layout.rank)
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise InvalidRequest(f"{field_name}.rank", "must be an integer")
        flags = {}
        for family in FAMILIES:
            flags[family] = config.get(f"train_{family}", True)
            if not isinstance(flags[family], bool):
                raise InvalidRequest(f"{field_name}.train_{family}", "must be true or false")
        shape = AdapterShape(rank, **flags)
        layout.check(shape, field_name)
        return layout.normal(shape)

    def new_model(api, body: dict, who: str, shape: AdapterShape | None = None) -> TinkerModel:
        """A model for `body`'s session, training `shape` of the job's adapter (refused where it cannot start)."""
        session_id = session(body.get("session_id"), who)
        base = body.get("base_model")
        if base is not None and base != model_name(api):
            raise InvalidRequest("base_model", f"this server trains {model_name(api)!r}, not {base!r}")
        if not residency.can_start(api, shape):
            raise InvalidRequest("lora_config", "a model of another rank or other modules than the job's adapter "
                                 f"(rank {api.adapter_layout().rank}, {api.config.engine.lora.target_modules}) starts "
                                 "from the untrained adapter, and this job's policy trained before its first Tinker "
                                 "model: none is kept")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise InvalidRequest("optimizer_config.type", f"{optimizer!r}: this server's optimizer is AdamW")
        seq = body.get("model_seq_id", 0)
        if not isinstance(seq, int):
            raise InvalidRequest("model_seq_id", "must be an integer")
        model_id = f"{session_id}:train:{seq}"
        if model_id in state.models:
            raise InvalidRequest("model_seq_id", f"this session already made model {seq}")
        for idle in [m for m in state.models.values() if m.session_id != session_id
                     and time.time() - state.sessions[m.session_id].seen >= SESSION_TIMEOUT_S]:
            release(api, idle)
        if len(state.models) >= state.max_models:
            raise InvalidRequest("base_model", f"this server trains at most {state.max_models} Tinker model(s) at once "
                                 "(arctic-rl serve --tinker-tenants) and that many train now; a model is freed when "
                                 f"its session finishes, or {SESSION_TIMEOUT_S:.0f} s after its last heartbeat")
        state.models[model_id] = TinkerModel(model_id, session_id, who, shape)
        rank = lora_rank(api, shape)
        metadata = body.get("user_metadata")
        rest.record_run(run_folder(who, model_id), {
            "training_run_id": model_id, "session_id": session_id, "base_model": model_name(api),
            "is_lora": rank is not None, "lora_rank": rank, "created": time.time(),
            "user_metadata": metadata if isinstance(metadata, dict) else None})
        return state.models[model_id]

    def done_now(value: dict, who: str) -> dict:
        """A future that is already resolved (calls that change no training state)."""
        request_id, outcome = state.futures.add(lambda result: result, who)
        outcome.set_result(value)
        return {"request_id": request_id}

    @app.post(f"{PREFIX}/create_model")
    async def create_model(request: Request):
        who = tenant(request)
        body = await read_json(request)
        api = api_of()
        model = new_model(api, body, who, lora_shape(api, body.get("lora_config")))
        return {**done_now({"model_id": model.model_id, "type": "create_model"}, who), "model_id": model.model_id}

    @app.post(f"{PREFIX}/arctic/state_digest")
    async def model_state_digest(request: Request):
        """Not a call of Tinker's: a digest of a model's weights and optimizer state, as the training API's
        `state_digest` gives the job's (a refused call changes neither; a run repeated gives the same)."""
        who = tenant(request)
        body = await read_json(request)
        model = owned_model(body.get("model_id"), who)

        def digest() -> str:
            enter(model)
            return api_of().state_digest()
        return {"digest": await asyncio.wrap_future(job.ordered.submit(digest))}

    @app.post(f"{PREFIX}/get_info")
    async def get_info(request: Request):
        who = tenant(request)
        body = await read_json(request)
        api, model = api_of(), owned_model(body.get("model_id"), who)
        rank = lora_rank(api, model.shape)
        return {"model_id": model.model_id, "type": "get_info", "model_name": model_name(api),
                "model_data": {"model_name": model_name(api), "tokenizer_id": api.config.model_path},
                "is_lora": rank is not None, "lora_rank": rank}

    @app.post(f"{PREFIX}/weights_info")
    async def weights_info(request: Request):
        who = tenant(request)
        body = await read_json(request)
        api = api_of()
        path = body.get("tinker_path")
        match = _TINKER_PATH.match(path if isinstance(path, str) else "")
        saved = state.sampler_paths.get(path) if isinstance(path, str) else None
        if match is None or not (saved is not None and saved.tenant == who or match.group("kind") == "weights" and
                                 os.path.isdir(checkpoint_dir(who, match.group("model"), match.group("name")))):
            raise NotFound("tinker_path", f"no checkpoint {path!r} on this server")
        shape = saved.shape if saved is not None else \
            saved_shape(api, checkpoint_dir(who, match.group("model"), match.group("name")))
        rank = lora_rank(api, shape)
        return {"base_model": model_name(api), "is_lora": rank is not None, "lora_rank": rank}

    # -- training -----------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-type", "").split(";")[0] != wire.MEDIA_TYPE:
            raise InvalidRequest("content-type", f"forward_backward takes {wire.MEDIA_TYPE}")
        body = await read_bytes(request)
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            try:
                body = zstandard.ZstdDecompressor().decompress(body, max_output_size=limits.tokens_per_call * 64)
            except zstandard.ZstdError as err:
                raise InvalidRequest("body", f"not a zstd frame within the server's cap: {err}") from None
        message = wire.parse_request(body)
        who = tenant(request)
        with in_turn(message.model_id, message.seq_id, who):
            batch = wire.decode_batch(message)
            api, model = api_of(), owned_model(batch.model_id, who)
            spec = loss_spec(batch.loss_fn, batch.config)
            sequences = with_loss_inputs(batch.loss_fn, batch.sequences, batch.inputs)
            limits.check("fwd_bwd", SimpleNamespace(sequences=sequences))

            def work():
                try:
                    if batch.forward_only:
                        scored = api.log_probs(sequences)
                        loss = evaluate(spec, sequences, scored.logprobs, scored.weight_version)
                        return scored.logprobs, {"loss:sum": loss}
                    result = api.fwd_bwd(sequences, spec, return_logprobs=True)
                    return result.logprobs, {"loss:sum": result.loss}
                except InvalidRequest as err:
                    raise _translated(err) from None

            def encode(result):
                return Response(wire.forward_backward_output(*result), media_type=wire.MEDIA_TYPE)

            return ordered(model, batch.seq_id, encode, work)

    def evaluate(spec: LossSpec, sequences: list[Sequence], logprobs: list[list[float]], version: int) -> float:
        """The loss `fwd_bwd` would report, on log-probs of a forward-only call (the registered loss itself)."""
        import torch

        entry = losses.get(spec.name, "loss_fn")
        config = entry.parse_config(spec.config, "loss_fn_config")
        flat = torch.from_numpy(np.concatenate([np.asarray(row, dtype=np.float32) for row in logprobs]))
        with torch.no_grad():
            loss, _ = entry.fn({"logprobs": flat}, batch_loss_inputs(sequences, version), config)
        return float(loss)

    def adam_settings(params) -> tuple[float, AdamSettings]:
        """Tinker's `AdamParams`, applied to this step as Tinker applies them: every field. The SDK sends NaN and
        infinities as null, so null is refused where a number is required, as every value out of range is."""
        if not isinstance(params, dict):
            raise InvalidRequest("adam_params", "must be the step's AdamParams")
        for key in ADAM_PARAMS:
            if key in params and (isinstance(params[key], bool) or not isinstance(params[key], (int, float))):
                raise InvalidRequest(f"adam_params.{key}", f"must be a number, got {params[key]!r} (the SDK sends "
                                     "NaN and infinities as null)")
        unknown = sorted(set(params) - set(ADAM_PARAMS))
        if unknown:
            raise InvalidRequest(f"adam_params.{unknown[0]}", f"is not a field of AdamParams ({', '.join(ADAM_PARAMS)})")
        learning_rate = params.get("learning_rate", ADAM_PARAMS["learning_rate"])
        if not 0 <= learning_rate <= MAX_LEARNING_RATE:
            raise InvalidRequest("adam_params.learning_rate", f"must be in [0, {MAX_LEARNING_RATE}], got {learning_rate}")
        given = {**ADAM_PARAMS, **params}
        try:
            return learning_rate, parse(AdamSettings, {
                "betas": [given["beta1"], given["beta2"]], "eps": given["eps"], "weight_decay": given["weight_decay"],
                "grad_clip": given["grad_clip_norm"]}, "adam")
        except InvalidRequest as err:
            field = {"adam.betas[0]": "beta1", "adam.betas[1]": "beta2", "adam.grad_clip": "grad_clip_norm"}.get(
                err.field, err.field.removeprefix("adam."))
            raise InvalidRequest(f"adam_params.{field}", err.message) from None

    @training_call("optim_step")
    def optim_step(body: dict, who: str) -> dict:
        api, model = api_of(), owned_model(body.get("model_id"), who)
        if "optimizer_params" in body:
            raise InvalidRequest("optimizer_params", "this server's optimizer is AdamW: send adam_params")
        learning_rate, adam = adam_settings(body.get("adam_params"))

        def work():
            return api.step(learning_rate, adam=adam)

        def encode(result):
            return JSONResponse({"type": "optim_step", "metrics": {
                "grad_norm": result.grad_norm, "learning_rate": result.learning_rate, "step": float(result.step)}})

        return ordered(model, body.get("seq_id"), encode, work)

    # -- weights ------------------------------------------------------------------------------------------

    def new_sampler(session_id: str, weights: SamplerWeights, path: str | None) -> str:
        sampler_id = f"{session_id}:sample:{uuid.uuid4().hex[:12]}"
        state.samplers[sampler_id] = Sampler(session_id, weights, path)
        tenant_of_session = state.sessions[session_id].tenant
        own = [key for key, s in state.samplers.items() if state.sessions[s.session_id].tenant == tenant_of_session]
        for key in own[: max(0, len(own) - SAMPLERS_PER_TENANT)]:  # an RL loop makes one per step: the oldest go
            del state.samplers[key]
        return sampler_id

    def serves_adapters(api) -> bool:
        """Whether models sample through their own adapters on the sampler's base weights (a LoRA job whose sampler
        serves adapters); otherwise through snapshots of their weights (`snapshots.py`)."""
        return api.adapter_layout() is not None and api.sampler.adapters > 0

    def keep_base(api) -> None:
        """On the ordered worker, before the first model trains: the base model's weights are kept as a snapshot,
        where the sampler and the engine still hold them (a job that trained or synced before keeps none)."""
        if api.weight_version == 0 and api.policy_untrained:
            folder = os.path.join(residency.root, "base-sampler")
            shutil.rmtree(folder, ignore_errors=True)
            api.save_full_weights(folder)
            state.base_folder = folder

    def retire_kept(model_id: str) -> None:
        """A model's sampler saves beyond its newest few are no longer sampled (their sampling sessions are refused),
        nor, past a few per model the server trains at once, those of models that left, oldest first. Each is
        dropped once the samples in flight with it end (vLLM reads an adapter's folder again when it must reload
        it; a snapshot's is read when the sampler loads it)."""
        own = [name for name, kept in state.kept.items() if kept.model_id == model_id]
        gone = [name for name, kept in state.kept.items() if kept.model_id not in state.models]
        excess = max(0, len(state.kept) - len(own[:-KEPT_PER_MODEL]) - KEPT_PER_MODEL * state.max_models)
        for name in own[:-KEPT_PER_MODEL] + gone[:excess]:
            retire(name, state.kept.pop(name))

    def retire(name: str, kept: Kept) -> None:
        """Drop kept weights now, or when their last sample in flight ends."""
        state.retired[name] = kept
        if not state.uses[name]:
            drop(name)

    def drop(name: str) -> None:
        kept = state.retired.pop(name)

        def remove():
            if kept.adapter:
                api_of().remove_adapter(name)
            shutil.rmtree(kept.folder, ignore_errors=True)
        asyncio.get_running_loop().run_in_executor(None, remove)

    @training_call("save_weights_for_sampler")
    def save_weights_for_sampler(body: dict, who: str) -> dict:
        api, model = api_of(), owned_model(body.get("model_id"), who)
        name = body.get("path")
        if name is not None:
            checkpoint_dir(who, model.model_id, name, "sampler_weights")  # checked now: the call fails before it runs
        # Each save its own folder: a name saved again never rewrites weights that are sampled.
        label = f"{'a' if serves_adapters(api) else 's'}{next(kept_ids)}"
        folder = checkpoint_dir(who, model.model_id, label, "sampler_weights")
        kept_name = f"{model.model_id}/{label}"

        def work() -> SamplerWeights:
            shutil.rmtree(folder, ignore_errors=True)
            if serves_adapters(api):
                api.save_adapter(folder)
                api.add_adapter(kept_name, folder)
            else:
                api.save_full_weights(folder)
            return SamplerWeights(who, kept_name, model.shape)

        def settle(weights: SamplerWeights) -> dict:
            state.kept[kept_name] = Kept(model.model_id, folder, serves_adapters(api))
            retire_kept(model.model_id)
            path = f"tinker://{model.model_id}/sampler_weights/{name if name is not None else label}"
            state.sampler_paths[path] = weights
            answer = {"type": "save_weights_for_sampler", "path": path}
            if name is None:  # the SDK's ephemeral save: it samples through the session made here
                answer["sampling_session_id"] = new_sampler(model.session_id, weights, path)
            return answer

        return ordered(model, body.get("seq_id"), JSONResponse, work, settle)

    @training_call("save_weights")
    def save_weights(body: dict, who: str) -> dict:
        api, model = api_of(), owned_model(body.get("model_id"), who)
        name = body.get("path")
        directory = checkpoint_dir(who, model.model_id, name)
        if os.path.exists(directory) and not body.get("overwrite", False):
            raise InvalidRequest("path", f"a checkpoint {name!r} exists; set overwrite to replace it")

        def work():
            info = api.save_checkpoint(directory)
            if api.adapter_layout() is not None:
                shape = model.shape or AdapterShape(api.adapter_layout().rank)
                with open(os.path.join(directory, SHAPE_FILE), "w") as f:
                    json.dump({"rank": shape.rank, **{f"train_{k}": getattr(shape, k) for k in FAMILIES}}, f)
            return info

        def encode(_):
            return JSONResponse({"type": "save_weights", "path": f"tinker://{model.model_id}/weights/{name}"})

        return ordered(model, body.get("seq_id"), encode, work)

    @training_call("save_weights_external")
    def save_weights_external(body: dict, who: str) -> dict:
        """The model's weights to take elsewhere: its PEFT adapter (a LoRA job) or the whole model in Hugging Face's
        format, under `external_weights/<name>`, downloaded through `get_external_weights_urls`."""
        api, model = api_of(), owned_model(body.get("model_id"), who)
        if body.get("age_encryption_recipients"):
            raise InvalidRequest("age_encryption_recipients", "this server does not encrypt what it exports")
        name = body.get("path")
        folder = checkpoint_dir(who, model.model_id, name, "external_weights")
        if os.path.exists(folder):
            raise InvalidRequest("path", f"external weights {name!r} exist; delete them or choose another name")
        expires = rest.expiry(body.get("ttl_seconds"), "ttl_seconds")

        def work() -> int:
            staging = folder + ".partial"  # listed and served only once whole
            shutil.rmtree(staging, ignore_errors=True)
            if api.adapter_layout() is not None:
                api.save_adapter(staging)
            else:
                api.save_hf(staging)
            os.replace(staging, folder)
            return rest.size(folder)

        path = f"tinker://{model.model_id}/external_weights/{name}"

        def settle(size: int) -> int:
            if expires is not None:
                rest.set_expiry(folder, expires)
            return size

        return ordered(model, body.get("seq_id"), lambda size: JSONResponse(
            {"type": "save_weights_external", "path": path, "size_bytes": size}), work, settle)

    @training_call("load_weights")
    def load_weights(body: dict, who: str) -> dict:
        api = api_of()
        path = body.get("path")
        match = _TINKER_PATH.match(path if isinstance(path, str) else "")
        if match is None or match.group("kind") != "weights":
            raise InvalidRequest("path", f"{path!r} is not a tinker://<model>/weights/<name> path of this server")
        directory = checkpoint_dir(who, match.group("model"), match.group("name"))
        if not os.path.isdir(directory):
            raise NotFound("path", f"no checkpoint {path!r} on this server")
        optimizer = body.get("optimizer", False)  # load_state: the weights, with a fresh optimizer
        if not isinstance(optimizer, bool):
            raise InvalidRequest("optimizer", "must be true or false")
        shape = saved_shape(api, directory)
        if "session_id" in body:  # the SDK's create-from-state: this load makes the model, before its call 1
            model = new_model(api, body, who, shape)
            request_id, start = deferred(model, lambda _: JSONResponse({"type": "load_weights", "path": path,
                                                                        "model_id": model.model_id}),
                                         lambda: api.load_checkpoint(directory, optimizer, publish=False))
            start()
            return {"request_id": request_id, "model_id": model.model_id}
        model = owned_model(body.get("model_id"), who)
        if shape != model.shape:
            raise InvalidRequest("path", f"{path!r} holds an adapter of rank {lora_rank(api, shape)} ({shape}); this "
                                 f"model trains rank {lora_rank(api, model.shape)} ({model.shape})")
        return ordered(model, body.get("seq_id"),
                       lambda _: JSONResponse({"type": "load_weights", "path": path, "model_id": model.model_id}),
                       lambda: api.load_checkpoint(directory, optimizer, publish=False))

    # -- sampling -----------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/create_sampling_session")
    async def create_sampling_session(request: Request):
        who = tenant(request)
        body = await read_json(request)
        api = api_of()
        session_id = session(body.get("session_id"), who)
        path, base = body.get("model_path"), body.get("base_model")
        if path is not None:
            weights = state.sampler_paths.get(path) if isinstance(path, str) else None
            if weights is None or weights.tenant != who:
                raise NotFound("model_path", f"no sampler weights {path!r} on this server")
        else:
            if base is not None and base != model_name(api):
                raise InvalidRequest("base_model", f"this server samples {model_name(api)!r}, not {base!r}")
            if not base_sampled(api):  # refused now, not at its first sample
                raise InvalidRequest("base_model", f"the sampler holds other weights (version {api.weight_version}) "
                                     "than the base model's, which this server did not keep: the job's policy trained "
                                     "or synced before the first Tinker model")
            weights = SamplerWeights(who)  # the base model: the job's initial weights
        return {"type": "create_sampling_session", "sampling_session_id": new_sampler(session_id, weights, path)}

    def base_sampled(api) -> bool:
        """Whether the base model can be sampled: the sampler holds it, or it is kept as a snapshot."""
        if serves_adapters(api):
            return api.weight_version == 0
        return state.hold.holds(api, BASE) or state.base_folder is not None

    def owned_sampler(sampler_id: Any, who: str, field_name: str) -> Sampler:
        sampler = state.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler is None or sampler.session_id not in state.sessions or \
                state.sessions[sampler.session_id].tenant != who:
            raise NotFound(field_name, f"no sampling session {sampler_id!r}")
        session(sampler.session_id, who)
        return sampler

    @app.get(f"{PREFIX}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request):
        sampler = owned_sampler(sampler_id, tenant(request), "sampler_id")
        return {"sampler_id": sampler_id, "base_model": model_name(api_of()), "model_path": sampler.model_path}

    @app.post(f"{PREFIX}/asample")
    async def asample(request: Request):
        who = tenant(request)
        body = await read_json(request)
        api = api_of()
        sampler = owned_sampler(body.get("sampling_session_id"), who, "sampling_session_id")
        topk = {}
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            topk[key] = body.get(key) or 0
            if not isinstance(topk[key], int) or not 0 <= topk[key] <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(key, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if body.get("prompt_alt_tokens_k"):
            raise InvalidRequest("prompt_alt_tokens_k", "is not supported by this server")
        for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(key) is not None:
                raise InvalidRequest(key, "is not supported by this server")
        if body.get("record_stability_info"):
            raise InvalidRequest("record_stability_info", "is not supported by this server")
        prompt = prompt_tokens(body.get("prompt"))
        params = dict(body.get("sampling_params") or {})
        num_samples = body.get("num_samples", 1)
        stop = params.pop("stop", None)
        top_k = params.pop("top_k", -1)
        max_tokens = params.pop("max_tokens", None)
        if max_tokens is None:
            max_tokens = min(max(api.sampler.max_context - len(prompt), 1), limits.max_tokens)
        # Tinker's stop: strings or token ids; an empty list stops on nothing, not even the end-of-sequence token.
        stops = ({} if stop is None else {"stop": [stop]} if isinstance(stop, str) else {"ignore_eos": True}
                 if stop == [] else {"stop_token_ids": stop} if all(isinstance(s, int) for s in stop) else {"stop": stop})
        with_prompt = bool(body.get("prompt_logprobs"))
        scored = with_prompt or topk["topk_prompt_logprobs"] > 0
        name = sampler.weights.kept
        kept = state.kept.get(name) if name is not None else None
        if name is not None and kept is None:
            raise InvalidRequest("sampling_session_id", f"its weights are no longer kept: each model's newest "
                                 f"{KEPT_PER_MODEL} saves for the sampler are, unless deleted; save weights again")
        adapter = name if kept is not None and kept.adapter else None
        # Tinker gives num_samples greedy samples, all alike; the sampler is asked for one (it takes n=1 greedy only).
        copies = num_samples if params.get("temperature", 1.0) == 0 and isinstance(num_samples, int) \
            and not isinstance(num_samples, bool) and num_samples > 1 else 1
        sampling = parse(SamplingParams, {**params, **stops, "n": num_samples // copies, "max_tokens": max_tokens,
                                          "adapter": adapter,
                                          "top_k": max(top_k, 0), "logprobs": topk["topk_sample_logprobs"],
                                          "prompt_logprobs": topk["topk_prompt_logprobs"] if scored else None},
                         "sampling_params")
        try:
            limits.check("generate", SimpleNamespace(prompts=[prompt], sampling=sampling))
            api.checked_generate([prompt], sampling)
        except InvalidRequest as err:
            raise type(err)(err.field.replace("prompts[0]", "prompt").replace("sampling.", "sampling_params."),
                            err.message) from None

        async def work():
            try:
                return await sample()
            finally:
                if name is not None:
                    state.uses[name] -= 1
                    if not state.uses[name]:
                        del state.uses[name]
                        if name in state.retired:
                            drop(name)

        async def sample():
            if serves_adapters(api):  # the sampler's base weights, under the session's adapter if any
                if api.weight_version != 0:
                    raise InvalidRequest("sampling_session_id", f"the sampler's base weights were replaced by version "
                                         f"{api.weight_version} (a sync of the training API)")
                completions = await serving.generate(api, job.reads, [prompt], sampling)
                version = 0
            else:
                folder = state.base_folder if name is None else kept.folder
                async with state.hold.holding(api, name or BASE, folder) as version:
                    completions = await serving.generate(api, job.reads, [prompt], sampling)
            stale = [v for c in completions for v in c.token_versions or [c.weight_version] if v != version]
            if stale:
                raise InvalidRequest("sampling_session_id", f"a weight sync (version {stale[0]}) crossed this sample")
            return completions * copies

        request_id, outcome = state.futures.add(lambda completions: Response(
            wire.sample_response(completions, with_prompt, topk["topk_prompt_logprobs"], topk["topk_sample_logprobs"]),
            media_type=wire.MEDIA_TYPE), who)
        if name is not None:  # counted now: a retirement from here on waits for this sample
            state.uses[name] += 1
        asyncio.ensure_future(work()).add_done_callback(lambda done: resolve(outcome, done))
        return {"request_id": request_id, "sample_sequence_ids": [uuid.uuid4().hex for _ in range(sampling.n * copies)]}

    def prompt_tokens(prompt: Any) -> list[int]:
        chunks = (prompt or {}).get("chunks") if isinstance(prompt, dict) else None
        if not chunks:
            raise InvalidRequest("prompt.chunks", "must hold at least one chunk")
        tokens = []
        for j, chunk in enumerate(chunks):
            if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
                raise InvalidRequest(f"prompt.chunks[{j}]", "this server samples from text tokens only")
            ids = chunk.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise InvalidRequest(f"prompt.chunks[{j}].tokens", "must be a list of token ids")
            tokens.extend(ids)
        if not tokens:
            raise InvalidRequest("prompt", "holds no tokens")
        return tokens

    def forget_sampler_path(path: str) -> None:
        """On the event loop: what was saved under `path` is no longer sampled (dropped once its samples in flight
        end)."""
        weights = state.sampler_paths.pop(path)
        if weights.kept in state.kept:
            retire(weights.kept, state.kept.pop(weights.kept))

    rest.add_rest_routes(app, state, PREFIX, tenant, read_json,
                         lambda who: confine(checkpoint_root, os.path.join("tinker", who)), forget_sampler_path)

    # -- futures ------------------------------------------------------------------------------------------

    @app.post(f"{PREFIX}/retrieve_future")
    async def retrieve_future(request: Request):
        who = tenant(request)
        body = await read_json(request)
        status, value = await state.futures.retrieve(body.get("request_id"), who)
        if status == "pending":
            return {"type": "try_again", "request_id": body.get("request_id"), "queue_state": "active"}
        if status == "failed":
            return _failure(value)
        return value if isinstance(value, Response) else JSONResponse(value)

