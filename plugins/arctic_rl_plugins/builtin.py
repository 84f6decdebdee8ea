"""The built-in plugin: Arctic RL's own losses, post-processors, engine and sampler.

Registered through the same `arctic_rl` entry point group as any third-party
plugin, so `arctic-rl plugins` shows built-ins and extensions alike.
"""

from __future__ import annotations

from arctic_rl_core.losses import gmpo, grpo, importance_sampling, post_processors, primerl, sft, value
from arctic_rl_core.plugins.hookspecs import hookimpl


@hookimpl
def arctic_rl_loss_fns():
    return [sft.sft_loss, importance_sampling.importance_sampling_loss, grpo.grpo_loss, gmpo.gmpo_loss,
            primerl.primerl_default_loss, primerl.primerl_ipo_loss, value.value_loss]


@hookimpl
def arctic_rl_post_processors():
    return [post_processors.apply_temperature, post_processors.compute_logprobs, post_processors.compute_entropy]


def _deepspeed_engine(config):
    if config.engine.ranks > 1:
        from arctic_rl_core.engines.trainer_group import TrainerGroup

        return TrainerGroup(config)
    from arctic_rl_core.engines.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(config)


def _transformers_sampler(config):
    from arctic_rl_core.samplers.transformers_sampler import TransformersSampler

    return TransformersSampler(config)


@hookimpl
def arctic_rl_training_engines():
    return {"deepspeed": _deepspeed_engine}


def _vllm_sampler(config):
    from arctic_rl_core.samplers.vllm_sampler import VLLMSampler

    return VLLMSampler(config)


@hookimpl
def arctic_rl_samplers():
    return {"vllm": _vllm_sampler, "transformers": _transformers_sampler}
