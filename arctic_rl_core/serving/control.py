"""The routes around sampling: health (`/health`, `/ping`, `/version`), `/metrics` (the engines' Prometheus metrics,
vLLM's names), `/v1/models`, and the RL control routes `/pause`, `/resume`, `/is_paused`, `/update_weights` (the job's
`sync_weights`), `/weight_info`, `/get_world_size`."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.samplers.engine_metrics import served_as
from arctic_rl_core.serving.pause import PauseMode
from arctic_rl_core.serving.request_path import RequestPath, installed_version


def add_routes(app: FastAPI, path: RequestPath, run_in) -> None:
    """`run_in(executor, fn)` runs training-state work on the job's ordered worker."""
    serving, job, api_of, read_json = path.serving, path.job, path.api_of, path.read_json

    @app.get("/health")
    async def health():
        api_of()
        return JSONResponse({})

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        """vLLM's (and SageMaker's) health check by another name."""
        api_of()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        """The vLLM version that samples, as `vllm serve` answers (clients check it); Arctic RL's beside it."""
        return {"version": _engine_version(), "arctic_rl": installed_version("arctic-rl")}

    @app.get("/metrics")
    async def metrics():
        """The sampler's engine metrics in Prometheus' text format, under vLLM's names (`vllm:num_requests_running`,
        `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`, ...), one `engine` label per replica."""
        api = api_of()
        exposition = served_as(await asyncio.to_thread(api.sampler.engine_metrics), serving.model_name(api))
        return PlainTextResponse(exposition, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        api = api_of()
        return {"object": "list", "data": [{
            "id": serving.model_name(api), "object": "model", "created": int(time.time()), "owned_by": "arctic-rl",
            "root": api.config.model_path, "max_model_len": api.sampler.max_context}]}

    # -- RL control: the weights the engine samples with ----------------------------------------------

    @app.post("/pause")
    async def pause(mode: PauseMode = Query("abort"), clear_cache: bool = Query(True)):
        await serving.gate.pause(mode)
        if mode == "abort" and job.api is not None:
            # The sampler ends the call in flight too, so a weight sync need not wait for it.
            await asyncio.to_thread(job.api.abort_generation)
        if mode == "keep" and job.api is not None and serving.frozen is None:
            # Requests in flight stop where they are; a weight update before /resume applies to the rest of each.
            api = job.api
            serving.frozen = api if await asyncio.to_thread(api.pause_generation) else None
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        if serving.frozen is not None:
            frozen, serving.frozen = serving.frozen, None
            await asyncio.to_thread(frozen.resume_generation)
        serving.gate.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": serving.gate.paused}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await read_json(request)
        extra = next((k for k in body if k != "weight_dir"), None) if isinstance(body, dict) else "body"
        if extra is not None:
            raise InvalidRequest(extra, "this server's weights come from its own trainer: update_weights takes no "
                                        "body (it syncs them) or only weight_dir")
        api = api_of()
        if isinstance(body, dict) and "weight_dir" in body:
            # prime-rl's orchestrator posts the folder whose STABLE marker it saw. Our trainer writes that marker
            # only after it synced the sampler, so the weights are here already; nothing is read from the folder.
            if not isinstance(body["weight_dir"], (str, type(None))):
                raise InvalidRequest("weight_dir", "must be a path or null")
            return {"message": "Weights are the trainer's, synced before it published them",
                    "weight_version": api.weight_version}
        def publish():
            if job.own_policy is not None:  # the job's own weights, not a Tinker model's the engine may hold
                job.own_policy()
            return api.sync_weights()

        version = await run_in(job.ordered, publish)
        return {"message": "Weights updated", "weight_version": version}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(api_of().weight_version)}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        sampler = api_of().config.sampler
        tensor_parallel = int(sampler.engine_args.get("tensor_parallel_size", 1))
        return {"world_size": tensor_parallel * (sampler.replicas if include_dp else 1)}


def _engine_version() -> str | None:
    """vLLM's own version string (`vllm.__version__`, as `vllm serve` reports it), where vLLM is installed."""
    try:
        from vllm import __version__
    except ImportError:
        return installed_version("arctic-rl")
    return __version__
