"""Connecting to the Arctic RL server at start-up, with errors that say which setting to fix."""

from __future__ import annotations

from arctic_rl_core import attach
from arctic_rl_core.attach import ArcticSetupError, client_for
from arctic_rl_core.client import ArcticRLClient

URL_KEY = "actor_rollout_ref.actor.arctic.url"
OPTIM_KEY = "actor_rollout_ref.actor.optim"
KEYS = attach.Keys(url=URL_KEY, model="actor_rollout_ref.model.path", optimizer=OPTIM_KEY, framework="verl")

CRITIC_KEYS = attach.Keys(url="critic.arctic.url", model="critic.model.path", optimizer="critic.optim", framework="verl")

__all__ = ["ArcticSetupError", "URL_KEY", "client_for", "connect", "connect_critic", "connect_reference"]


def connect(arctic, model_config, optimizer_config=None) -> ArcticRLClient:
    """A client for the server named by the `arctic` settings, with its job checked (or started)
    for the same model verl loaded."""
    client, status = attach.reach(arctic.url, arctic.token_env, arctic.timeout_s, KEYS, retries=1)
    job = dict(arctic.job or {})
    engine = dict(job.pop("engine", {}))
    if optimizer_config is not None:
        engine.setdefault("learning_rate", optimizer_config.lr)
        for key, value in _optimizer(optimizer_config).items():
            engine.setdefault(key, value)
    job = {"model_path": arctic.model_path or model_config.local_path, "engine": engine, **job}
    mode = getattr(getattr(arctic, "router_replay", None), "mode", "disabled")
    if mode != "disabled":
        job.setdefault("router_replay", mode)
    status = attach.start_or_get_job(client, status, job, " (see actor_rollout_ref.actor.arctic.job / .model_path)")
    attach.check_model(model_config.local_path, model_config.hf_config.to_dict(), status, KEYS)
    if mode != "disabled" and status["backend"].get("router_replay", "off") == "off":
        raise ArcticSetupError(f"actor_rollout_ref.actor.arctic.router_replay.mode={mode}: the Arctic RL job replays no "
                               "routing (its router_replay is off, or its model is dense); start it with router_replay: "
                               f"{mode}")
    if optimizer_config is not None:
        # The learning rate (verl's schedule) reaches each step; the rest is the job's (set when the adapter
        # starts the job, else job.yaml), so it must be verl's.
        if getattr(optimizer_config, "optimizer", "AdamW") not in ("AdamW", "adamw"):
            raise ArcticSetupError(f"{OPTIM_KEY}.optimizer={optimizer_config.optimizer}: the Arctic RL job trains with AdamW")
        attach.check_optimizer(_optimizer(optimizer_config), status,
                               {"weight_decay": "weight_decay", "betas": "betas", "grad_clip": "clip_grad"}, KEYS)
    return client


def _optimizer(optim) -> dict:
    """verl's AdamW settings as the job holds them; `grad_clip` is verl's newer name for `clip_grad` (0/None: off)."""
    clip = optim.grad_clip if getattr(optim, "grad_clip", None) is not None else optim.clip_grad
    return attach.optimizer_settings(optim.weight_decay, optim.betas, clip)


def connect_reference(arctic, model_config) -> ArcticRLClient:
    """A client for the server's reference model, which verl's ref worker (`forward_only`) reads its log-probs from:
    the job's, on the weights of verl's reference (actor_rollout_ref.model.path)."""
    client, status = attach.reach(arctic.url, arctic.token_env, arctic.timeout_s, KEYS, retries=1)
    if not status["initialized"]:
        raise ArcticSetupError(f"the Arctic RL server at {arctic.url} runs no job, and verl builds its reference before "
                               "its actor: start the server with a job (--config) holding reference.enable: true")
    attach.check_reference(model_config.local_path, status, "actor_rollout_ref.model.path")
    return client


def connect_critic(arctic, model_config, optimizer_config) -> ArcticRLClient:
    """A client for the server's critic, which verl's critic worker trains and reads its values from: the job's
    (`critic.enable`), on the weights of verl's critic model (critic.model.path), with verl's `critic.optim`."""
    client, status = attach.reach(arctic.url, arctic.token_env, arctic.timeout_s, CRITIC_KEYS, retries=1)
    if not status["initialized"]:
        raise ArcticSetupError(f"the Arctic RL server at {arctic.url} runs no job, and verl builds its critic before "
                               "its actor: start the server with a job (--config) holding critic.enable: true")
    critic = attach.check_critic(model_config.local_path, status, CRITIC_KEYS.model)
    if getattr(optimizer_config, "optimizer", "AdamW") not in ("AdamW", "adamw"):
        raise ArcticSetupError(f"critic.optim.optimizer={optimizer_config.optimizer}: the Arctic RL critic trains with AdamW")
    attach.check_optimizer(_optimizer(optimizer_config), critic,
                           {"weight_decay": "weight_decay", "betas": "betas", "grad_clip": "clip_grad"}, CRITIC_KEYS)
    return client
