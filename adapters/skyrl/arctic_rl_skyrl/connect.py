"""Connecting to the Arctic RL server at start-up, before SkyRL builds anything: the server answers, its job
trains the model SkyRL loaded (same shape and weights), with SkyRL's optimizer settings, and, for GAE, its
critic on SkyRL's critic model with the critic's optimizer settings."""

from __future__ import annotations

from dataclasses import replace

from transformers import AutoConfig

from arctic_rl_core import attach
from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_skyrl import replay
from arctic_rl_skyrl.losses import uses_critic, uses_reference
from arctic_rl_skyrl.settings import PREFIX, ArcticSettings

PROXY = "generator.inference_engine.external_proxy_url"
KEYS = attach.Keys(url=f"{PREFIX}url", model="trainer.policy.model.path", optimizer="trainer.policy.optimizer_config",
                   framework="SkyRL")
CRITIC_KEYS = replace(KEYS, model="trainer.critic.model.path", optimizer="trainer.critic.optimizer_config")
OPTIMIZER_NAMES = {"weight_decay": "weight_decay", "betas": "adam_betas", "grad_clip": "max_grad_norm"}


def _optimizer(optim) -> dict:
    return attach.optimizer_settings(optim.weight_decay, optim.adam_betas, optim.max_grad_norm)


def check_inference(cfg, settings: ArcticSettings) -> None:
    """SkyRL's generator must sample from the server (its vLLM-compatible routes), not from engines of its own."""
    if not settings.url:
        raise ArcticSetupError(f"{KEYS.url} is not set: give the address of an `arctic-rl serve`")
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
    client, status = attach.reach(settings.url, settings.token_env, settings.timeout_s, KEYS)
    optim = cfg.trainer.policy.optimizer_config
    ours = _optimizer(optim)
    model_path = cfg.trainer.policy.model.path
    job = {"model_path": model_path, "engine": {"learning_rate": optim.lr, **ours}}
    if uses_reference(cfg):
        ref_path = cfg.trainer.ref.model.path
        job["reference"] = {"enable": True, "model_path": None if ref_path == model_path else ref_path,
                            **({"router_replay": True} if replay.reference_replays(cfg) else {})}
    job.update(replay.job_settings(cfg))
    if uses_critic(cfg):
        critic = cfg.trainer.critic
        job["critic"] = {"enable": True, "model_path": None if critic.model.path == model_path else critic.model.path,
                         "engine": {"learning_rate": critic.optimizer_config.lr, **_optimizer(critic.optimizer_config)}}
    status = attach.start_or_get_job(client, status, job)
    attach.check_model(model_path, AutoConfig.from_pretrained(model_path).to_dict(), status, KEYS)
    attach.check_optimizer(ours, status, OPTIMIZER_NAMES, KEYS)
    replay.check_job(cfg, status)
    if uses_reference(cfg):
        attach.check_reference(cfg.trainer.ref.model.path, status, "trainer.ref.model.path")
    if uses_critic(cfg):
        served = attach.check_critic(cfg.trainer.critic.model.path, status, CRITIC_KEYS.model)
        attach.check_optimizer(_optimizer(cfg.trainer.critic.optimizer_config), served, OPTIMIZER_NAMES, CRITIC_KEYS)
    return client
