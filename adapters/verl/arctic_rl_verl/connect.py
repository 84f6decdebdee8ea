"""Connecting to the Arctic RL server at start-up, with errors that say which setting to fix."""

from __future__ import annotations

import os

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable
from arctic_rl_core.types import MODEL_SHAPE_KEYS, model_shape

URL_KEY = "actor_rollout_ref.actor.arctic.url"


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
        job = dict(arctic.job)
        engine = dict(job.pop("engine", {}))
        if optimizer_config is not None:
            engine.setdefault("learning_rate", optimizer_config.lr)
            engine.setdefault("weight_decay", optimizer_config.weight_decay)
            if optimizer_config.clip_grad:
                engine.setdefault("grad_clip", optimizer_config.clip_grad)
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
    return client
