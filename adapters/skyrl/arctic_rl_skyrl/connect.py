"""Connecting to the Arctic RL server at start-up, before SkyRL builds anything: the server answers, its job
trains the model SkyRL loaded (same shape and weights), with SkyRL's optimizer settings."""

from __future__ import annotations

import os

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
from arctic_rl_core.types import MODEL_SHAPE_KEYS, model_shape
from arctic_rl_skyrl.losses import ArcticSetupError
from arctic_rl_skyrl.settings import PREFIX, ArcticSettings

OPTIM = "trainer.policy.optimizer_config"
PROXY = "generator.inference_engine.external_proxy_url"


def check_inference(cfg, settings: ArcticSettings) -> None:
    """SkyRL's generator must sample from the server (its vLLM-compatible routes), not from engines of its own."""
    if not settings.url:
        raise ArcticSetupError(f"{PREFIX}url is not set: give the address of an `arctic-rl serve`")
    engine = cfg.generator.inference_engine
    if engine.run_engines_locally or not engine.external_proxy_url:
        raise ArcticSetupError(f"SkyRL would start its own vLLM engines: set generator.inference_engine."
                               f"run_engines_locally=false {PROXY}=<the Arctic RL server's address>")
    if engine.external_proxy_url.rstrip("/") != settings.url.rstrip("/"):
        raise ArcticSetupError(f"{PROXY}={engine.external_proxy_url} is not {PREFIX}url={settings.url}: rollouts must "
                               "come from the sampler the trainer syncs")
    if engine.external_server_urls and any(u.rstrip("/") != settings.url.rstrip("/") for u in engine.external_server_urls):
        raise ArcticSetupError("generator.inference_engine.external_server_urls names other servers than "
                               f"{PREFIX}url: leave it unset")
    if engine.enable_ray_prometheus_stats:
        raise ArcticSetupError("generator.inference_engine.enable_ray_prometheus_stats=true scrapes the vLLM engines "
                               "SkyRL runs under Ray, and there are none: set it to false (the Arctic RL server's "
                               "sampler reports in its /v1/status)")
    if cfg.trainer.hf_save_interval > 0:
        raise ArcticSetupError("trainer.hf_save_interval > 0: the weights are the Arctic RL server's; export them "
                               "from its checkpoints instead (set it to -1)")


def connect(cfg, settings: ArcticSettings) -> ArcticRLClient:
    client = ArcticRLClient(settings.url, token=os.environ.get(settings.token_env), timeout_s=settings.timeout_s)
    try:
        status = client.status()
    except BackendUnavailable as err:
        raise ArcticSetupError(f"no Arctic RL server answers at {settings.url} ({err}); start `arctic-rl serve` there "
                               f"or fix {PREFIX}url") from None
    except ArcticRLError as err:
        raise ArcticSetupError(f"the Arctic RL server at {settings.url} refused the connection ({err}); set "
                               f"${settings.token_env} to its token") from None
    optim = cfg.trainer.policy.optimizer_config
    ours = {"weight_decay": float(optim.weight_decay), "betas": [float(b) for b in optim.adam_betas],
            "grad_clip": float(optim.max_grad_norm) if optim.max_grad_norm > 0 else None}
    model_path = cfg.trainer.policy.model.path
    if not status["initialized"]:
        try:
            client.initialize({"model_path": model_path, "engine": {"learning_rate": optim.lr, **ours}})
        except ArcticRLError as err:
            raise ArcticSetupError(f"the Arctic RL server could not start a job on {model_path}: {err}") from None
        status = client.status()
    _check_model(model_path, status, settings.url)
    engine = status["config"]["engine"]
    job = {"weight_decay": float(engine.get("weight_decay", 0.0)), "betas": [float(b) for b in engine.get("betas", [])],
           "grad_clip": engine.get("grad_clip")}
    names = {"weight_decay": "weight_decay", "betas": "adam_betas", "grad_clip": "max_grad_norm"}
    for key, value in ours.items():
        if value != job[key]:
            raise ArcticSetupError(f"{OPTIM}.{names[key]}={value} but the Arctic RL job runs engine.{key}={job[key]}: "
                                   "set one to the other (the server's job.yaml, or this override)")
    return client


def _check_model(model_path: str, status: dict, url: str) -> None:
    from transformers import AutoConfig

    served = status["backend"]["model"]
    ours = model_shape(AutoConfig.from_pretrained(model_path).to_dict())
    differing = {k: (ours[k], served.get(k)) for k in MODEL_SHAPE_KEYS if ours[k] != served.get(k)}
    if differing:
        detail = ", ".join(f"{k}: SkyRL {a!r} vs server {b!r}" for k, (a, b) in differing.items())
        raise ArcticSetupError(f"trainer.policy.model.path is not the model the Arctic RL server at {url} trains "
                               f"({status['config']['model_path']}): {detail}")
    ours_print, served_print = checkpoint_fingerprint(model_path), status["backend"].get("weights_fingerprint")
    if ours_print and served_print and ours_print != served_print:
        raise ArcticSetupError(f"trainer.policy.model.path ({model_path}) holds other weights than the model the Arctic "
                               f"RL server at {url} trains (same shape, different checkpoint)")
