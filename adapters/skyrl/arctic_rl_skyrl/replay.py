"""SkyRL's MoE router replay (R3) on the backend.

SkyRL asks for it with its Megatron keys: `trainer.policy.megatron_config.moe_enable_routing_replay` with
`generator.inference_engine.enable_return_routed_experts` (and, for the reference model,
`trainer.ref.megatron_config.moe_enable_routing_replay`); SkyRL's own validation then wants
`trainer.strategy=megatron`. No Megatron worker starts here: the Arctic RL job is the trainer, and replays each
row's recorded routing in its log-probs and updates (`router_replay: R3`). Its generator's requests go to the
server's `/skyrl/v1/generate`, which returns the routing the sampler recorded in SkyRL's packed form.
"""

from __future__ import annotations

from arctic_rl_core.attach import ArcticSetupError

POLICY_KEY = "trainer.policy.megatron_config.moe_enable_routing_replay"
REFERENCE_KEY = "trainer.ref.megatron_config.moe_enable_routing_replay"


def replays(cfg) -> bool:
    """Whether SkyRL's policy replays the rollout's routing."""
    return bool(getattr(cfg.trainer.policy.megatron_config, "moe_enable_routing_replay", False))


def reference_replays(cfg) -> bool:
    return bool(getattr(cfg.trainer.ref.megatron_config, "moe_enable_routing_replay", False))


def check_router_replay(cfg) -> None:
    """`trainer.strategy=megatron` stands for router replay only (the job trains, not SkyRL's Megatron workers)."""
    if cfg.trainer.strategy == "megatron" and not replays(cfg):
        raise ArcticSetupError("trainer.strategy=megatron: the Arctic RL job is the trainer, so Megatron stands here only "
                               f"for SkyRL's router replay ({POLICY_KEY}=true); otherwise leave trainer.strategy=fsdp")
    if reference_replays(cfg) and not replays(cfg):
        raise ArcticSetupError(f"{REFERENCE_KEY}=true without {POLICY_KEY}=true: the reference replays the rollout's "
                               "routing only where the policy does")


def job_settings(cfg) -> dict:
    """What the job needs for SkyRL's router replay (when the adapter starts it)."""
    if not replays(cfg):
        return {}
    return {"router_replay": "R3"}  # the job's sampler records the routing it samples with (docs/losses.md)


def check_job(cfg, status: dict) -> None:
    """The job replays what SkyRL asks it to, refused at start-up otherwise."""
    if replays(cfg) and status["backend"].get("router_replay", "off") != "R3":
        raise ArcticSetupError(f"{POLICY_KEY}=true: the Arctic RL job replays no recorded routing (its router_replay is "
                               "not R3, or its model is dense); start it with router_replay: R3")
    reference = status["backend"].get("reference") or {}
    if reference_replays(cfg) and not reference.get("router_replay"):
        raise ArcticSetupError(f"{REFERENCE_KEY}=true: the Arctic RL job's reference model replays no routing; start it "
                               "with reference.router_replay: true")
