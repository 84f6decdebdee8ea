"""Connecting to the Arctic RL server at start-up, with errors that say which setting to fix."""

from __future__ import annotations

import os

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
from arctic_rl_core.types import MODEL_SHAPE_KEYS, model_shape

URL_KEY = "actor_rollout_ref.actor.arctic.url"
OPTIM_KEY = "actor_rollout_ref.actor.optim"


class ArcticSetupError(RuntimeError):
    """The adapter cannot work with this configuration; the message says what to change."""


def client_for(url: str, token_env: str, timeout_s: float, retries: int = 3) -> ArcticRLClient:
    """A client for the server at `url`, with the bearer token from environment variable `token_env`."""
    return ArcticRLClient(url, token=os.environ.get(token_env), timeout_s=timeout_s, retries=retries)


def connect(arctic, model_config, optimizer_config=None) -> ArcticRLClient:
    """A client for the server named by the `arctic` settings, with its job checked (or started)
    for the same model verl loaded."""
    if not arctic.url:
        raise ArcticSetupError(f"{URL_KEY} is not set: give the address of an `arctic-rl serve`")
    client = client_for(arctic.url, arctic.token_env, arctic.timeout_s, retries=1)
    try:
        status = client.status()
    except BackendUnavailable as err:
        raise ArcticSetupError(f"no Arctic RL server answers at {arctic.url} ({err}); start `arctic-rl serve` "
                               f"there or fix {URL_KEY}") from None
    except ArcticRLError as err:
        raise ArcticSetupError(f"the Arctic RL server at {arctic.url} refused the connection ({err}); "
                               f"set ${arctic.token_env} to its token") from None
    if not status["initialized"]:
        job = dict(arctic.job or {})
        engine = dict(job.pop("engine", {}))
        if optimizer_config is not None:
            engine.setdefault("learning_rate", optimizer_config.lr)
            engine.setdefault("weight_decay", optimizer_config.weight_decay)
            engine.setdefault("betas", list(optimizer_config.betas))
            engine.setdefault("grad_clip", _grad_clip(optimizer_config))
        model_path = arctic.model_path or model_config.local_path
        try:
            client.initialize({"model_path": model_path, "engine": engine, **job})
        except ArcticRLError as err:
            raise ArcticSetupError(f"the Arctic RL server could not start the job: {err} "
                                   "(see actor_rollout_ref.actor.arctic.job / .model_path)") from None
        status = client.status()
    served = status["backend"]["model"]
    ours = model_shape(model_config.hf_config.to_dict())
    differing = {k: (ours[k], served.get(k)) for k in MODEL_SHAPE_KEYS if ours[k] != served.get(k)}
    if differing:
        detail = ", ".join(f"{k}: verl {a!r} vs server {b!r}" for k, (a, b) in differing.items())
        raise ArcticSetupError(f"actor_rollout_ref.model.path is not the model the Arctic RL server at {arctic.url} "
                               f"trains ({status['config']['model_path']}): {detail}")
    ours_print, served_print = checkpoint_fingerprint(model_config.local_path), status["backend"].get("weights_fingerprint")
    if ours_print and served_print and ours_print != served_print:
        raise ArcticSetupError(f"actor_rollout_ref.model.path ({model_config.local_path}) holds other weights than the "
                               f"model the Arctic RL server at {arctic.url} trains ({status['config']['model_path']}): "
                               "same shape, different checkpoint (weights fingerprints differ)")
    if optimizer_config is not None:
        check_optimizer(optimizer_config, status["config"]["engine"])
    return client


def _grad_clip(optim) -> float | None:
    """verl's gradient clipping (`grad_clip` is its newer name for `clip_grad`); 0 or None: off."""
    clip = optim.grad_clip if getattr(optim, "grad_clip", None) is not None else optim.clip_grad
    return float(clip) if clip else None


def check_optimizer(optim, engine: dict) -> None:
    """Every verl optimizer setting the job does not honour is refused here, by name: the learning rate (verl's
    schedule) reaches each step, the rest is the job's (set when the adapter starts the job, else job.yaml)."""
    if getattr(optim, "optimizer", "AdamW") not in ("AdamW", "adamw"):
        raise ArcticSetupError(f"{OPTIM_KEY}.optimizer={optim.optimizer}: the Arctic RL job trains with AdamW")
    ours = {"weight_decay": float(optim.weight_decay), "betas": [float(b) for b in optim.betas],
            "clip_grad": _grad_clip(optim)}
    job = {"weight_decay": float(engine.get("weight_decay", 0.0)), "betas": [float(b) for b in engine.get("betas", [])],
           "clip_grad": engine.get("grad_clip")}
    names = {"weight_decay": "engine.weight_decay", "betas": "engine.betas", "clip_grad": "engine.grad_clip"}
    for key, value in ours.items():
        if value != job[key]:
            raise ArcticSetupError(f"{OPTIM_KEY}.{key}={value} but the Arctic RL job runs {names[key]}={job[key]}: "
                                   f"set one to the other (the server's job.yaml, or this override)")
