"""Entry point `verl.plugins: arctic_rl`, imported by `import verl` in every verl process.

verl ignores what the import returns and hides its errors at debug level, so this module
registers everything as it is imported and logs its own failures loudly. In order:
1. on machines without an accelerator, a CPU platform (before verl first resolves one), and,
   only in processes of a run that selects the arctic-rl backend, the process-group patch
   that CPU needs (the one change to verl's own behaviour);
2. the `arctic_rl` training engine and rollout, under names of their own;
3. the `arctic_rl_backend` config resolver (`trainer.backend` in `arctic_ppo_trainer`).

A run selects the backend with `trainer.backend=arctic-rl` in the `arctic_ppo_trainer`
config, which also puts `ARCTIC_RL_VERL_BACKEND` into the environment of every Ray worker
(`ray_kwargs.ray_init.runtime_env`), where the workers' process groups are made.
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger("arctic_rl_verl")
BACKENDS = {"arctic-rl": "arctic_rl"}
SELECTED_ENV = "ARCTIC_RL_VERL_BACKEND"
"""Set (by the arctic_ppo_trainer config) in the processes of a run that selects the arctic-rl backend."""


def selected() -> bool:
    return os.environ.get(SELECTED_ENV) in BACKENDS


def backend_name(choice: str) -> str:
    """`trainer.backend` -> verl's engine/rollout name; anything else is a configuration error."""
    if choice not in BACKENDS:
        raise ValueError(f"trainer.backend={choice!r}: the arctic_ppo_trainer config serves {', '.join(BACKENDS)}")
    return BACKENDS[choice]


def cpu_process_group_patch():
    """verl's workers join a process group with backend "cpu:gloo,<device>:<comm>", which on a CPU
    platform reads "cpu:gloo,cpu:gloo" and torch refuses; plain gloo is what CPU needs."""
    import verl.utils.distributed as verl_distributed

    from arctic_rl_core.patches import Patch

    def make(original):
        def initialize_global_process_group_ray(timeout_second=None, backend=None):
            return original(timeout_second=timeout_second, backend=backend or "gloo")

        return initialize_global_process_group_ray

    return Patch(verl_distributed, "initialize_global_process_group_ray", make,
                 reason="CPU platform: join the process group with plain gloo", by=__name__)


ROLLOUT_MODULE = "arctic_rl_verl.rollout"


def register_rollout() -> None:
    """The rollout is registered by name, never by importing its module here: a Ray worker unpickling the
    rollout's class imports that module first, and its `import verl` runs this plugin before it is complete."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from arctic_rl_core.patches import set_item

    RolloutReplicaRegistry.register("arctic_rl", lambda: importlib.import_module(ROLLOUT_MODULE).ArcticReplica)
    # verl keeps the hybrid-worker rollouts in a plain dict with no register function.
    set_item(rollout_base._ROLLOUT_REGISTRY, ("arctic_rl", "async"), f"{ROLLOUT_MODULE}.ArcticRolloutAdapter",
             "verl's hybrid workers find the arctic_rl rollout by this table entry", __name__,
             where="verl.workers.rollout.base._ROLLOUT_REGISTRY")


def load() -> None:
    import torch
    from omegaconf import OmegaConf

    if not torch.cuda.is_available():
        from arctic_rl_verl import platform_cpu  # noqa: F401  (registers the platform)

        if selected():
            cpu_process_group_patch().apply()
    from arctic_rl_verl import engine  # noqa: F401  (registers the engine)

    register_rollout()
    OmegaConf.register_new_resolver("arctic_rl_backend", backend_name, replace=True)


try:
    load()
except Exception:
    logger.exception("the arctic_rl verl plugin failed to load; verl will not find the arctic_rl engine or rollout")
    raise
