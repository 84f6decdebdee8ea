"""An adapter attaching a framework to an Arctic RL server at start-up, with errors that name the framework's key.

`reach` answers whether the server is there and lets us in; `start_or_get_job` gives it a job on the
framework's model when it has none; `check_model` and `check_optimizer` refuse a job that is not
what the framework would train (another model, other weights of the same shape, other optimizer
settings), so a misconfigured run stops in seconds rather than training the wrong thing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.errors import ArcticRLError, BackendUnavailable
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
from arctic_rl_core.types import MODEL_SHAPE_KEYS, model_shape


class ArcticSetupError(RuntimeError):
    """The adapter cannot work with this configuration; the message says what to change."""


@dataclass(frozen=True)
class Keys:
    """The framework's names for what a start-up error points at."""

    url: str
    model: str
    optimizer: str
    framework: str


def client_for(url: str, token_env: str, timeout_s: float, retries: int = 3) -> ArcticRLClient:
    """A client for the server at `url`, with the bearer token from environment variable `token_env`."""
    return ArcticRLClient(url, token=os.environ.get(token_env), timeout_s=timeout_s, retries=retries)


def reach(url: str | None, token_env: str, timeout_s: float, keys: Keys, retries: int = 3) -> tuple[ArcticRLClient, dict]:
    """A client for the server at `url` (its bearer token from `$token_env`) and the server's status."""
    if not url:
        raise ArcticSetupError(f"{keys.url} is not set: give the address of an `arctic-rl serve`")
    client = client_for(url, token_env, timeout_s, retries)
    try:
        return client, client.status()
    except BackendUnavailable as err:
        raise ArcticSetupError(f"no Arctic RL server answers at {url} ({err}); start `arctic-rl serve` there "
                               f"or fix {keys.url}") from None
    except ArcticRLError as err:
        raise ArcticSetupError(f"the Arctic RL server at {url} refused the connection ({err}); set ${token_env} "
                               "to its token") from None


def start_or_get_job(client: ArcticRLClient, status: dict, job: dict, hint: str = "") -> dict:
    """The server's status once it has a job: `job` (a BackendConfig) is started if it has none."""
    if status["initialized"]:
        return status
    try:
        client.initialize(job)
    except ArcticRLError as err:
        raise ArcticSetupError(f"the Arctic RL server could not start a job on {job.get('model_path')}: {err}{hint}") from None
    return client.status()


def check_model(model_path: str, hf_config: dict, status: dict, keys: Keys) -> None:
    """The server trains the model the framework loaded: same shape, and the same weights where both have a
    fingerprint of their checkpoint."""
    served = status["backend"]["model"]
    ours = model_shape(hf_config)
    differing = {k: (ours[k], served.get(k)) for k in MODEL_SHAPE_KEYS if ours[k] != served.get(k)}
    if differing:
        detail = ", ".join(f"{k}: {keys.framework} {a!r} vs server {b!r}" for k, (a, b) in differing.items())
        raise ArcticSetupError(f"{keys.model} is not the model the Arctic RL server trains "
                               f"({status['config']['model_path']}): {detail}")
    ours_print, served_print = checkpoint_fingerprint(model_path), status["backend"].get("weights_fingerprint")
    if ours_print and served_print and ours_print != served_print:
        raise ArcticSetupError(f"{keys.model} ({model_path}) holds other weights than the model the Arctic RL server "
                               f"trains ({status['config']['model_path']}): same shape, different checkpoint "
                               "(weights fingerprints differ)")


def optimizer_settings(weight_decay: float, betas, grad_clip: float | None) -> dict:
    """AdamW's settings as the job's `engine` holds them (grad_clip None: off)."""
    return {"weight_decay": float(weight_decay), "betas": [float(b) for b in betas],
            "grad_clip": float(grad_clip) if grad_clip else None}


def check_optimizer(ours: dict, status: dict, names: dict[str, str], keys: Keys) -> None:
    """The job runs the framework's optimizer settings (`ours`, from `optimizer_settings`); `names` maps each to
    the framework's key under `keys.optimizer`."""
    engine = status["config"]["engine"]
    job = optimizer_settings(engine.get("weight_decay", 0.0), engine.get("betas", []), engine.get("grad_clip"))
    for key, value in ours.items():
        if value != job[key]:
            raise ArcticSetupError(f"{keys.optimizer}.{names[key]}={value} but the Arctic RL job runs engine.{key}="
                                   f"{job[key]}: set one to the other (the server's job.yaml, or this override)")


def _check_role(role: str, what: str, path: str, status: dict, key: str, need: str) -> dict:
    """The job's `role` ("reference", "critic") as status describes it, on the weights of the framework's `path`
    (`key`), or an error saying what to start the job with."""
    served = status["backend"].get(role)
    if served is None:
        raise ArcticSetupError(f"{need} needs the Arctic RL job's {what} ({key}): start the server's job with "
                               f"{role}.enable: true")
    ours = checkpoint_fingerprint(path)
    if ours and served.get("weights_fingerprint") and ours != served["weights_fingerprint"]:
        raise ArcticSetupError(f"{key} ({path}) holds other weights than the Arctic RL job's {what} "
                               f"({served['model_path']})")
    return served


def check_reference(ref_path: str, status: dict, key: str) -> None:
    """A framework's KL terms need the job's reference model, on the weights of the framework's reference (`key`)."""
    _check_role("reference", "reference model", ref_path, status, key, "a KL term")


def check_critic(critic_path: str, status: dict, key: str) -> dict:
    """A framework's critic needs the job's critic (`critic.enable`), whose decoder is on the weights of the
    framework's critic model (`key`). Returns the critic's engine settings (the job's `engine` under
    `critic.engine`) in the form `check_optimizer` reads a status."""
    _check_role("critic", "critic", critic_path, status, key, "a critic")
    config = status["config"]
    return {"config": {"engine": {**config["engine"], **config.get("critic", {}).get("engine", {})}}}
