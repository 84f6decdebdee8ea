"""`bench frameworks`' workload as a SkyRL-Gym environment, and the entry point that registers it, as SkyRL documents a
custom environment (its own `main` registers the environment where the trainer's generator runs, then runs SkyRL's
experiment: `main_base`'s, or SkyRL's fully async trainer as its fully async example runs it). Rewarded as the other
frameworks' columns are: 1 for a reply holding the answer's first digit (`workload.REWARD`), so a random model earns
mixed rewards and its weights move.

Alone, SkyRL's trainer runs in a Ray task, so the environment is registered there; through Arctic RL, the adapter's
entry point runs the trainer in this process.
"""

from __future__ import annotations

import sys

ENV_ID = "arctic_sql"


def register() -> None:
    from skyrl_gym.envs import register as register_env
    from skyrl_gym.envs.registration import registry

    if ENV_ID not in registry:
        register_env(id=ENV_ID, entry_point="skyrl_sql.env:SqlEnv")


def experiment(cfg):
    """SkyRL's experiment for `cfg`: its fully async trainer where `trainer.fully_async.enabled` (SkyRL's
    main_base runs the synchronous one whatever the setting; SkyRL's fully async example subclasses its experiment
    this way), else main_base's."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    if not cfg.trainer.fully_async.enabled:
        return BasePPOExp(cfg)
    from skyrl.train.fully_async_trainer import FullyAsyncRayPPOTrainer

    class FullyAsyncPPOExp(BasePPOExp):
        def get_trainer(self, *args, **kwargs):
            return FullyAsyncRayPPOTrainer(*args, **kwargs)

    return FullyAsyncPPOExp(cfg)


def main() -> None:
    from skyrl.train.entrypoints import main_base

    if any(arg.startswith("trainer.override_entrypoint=") for arg in sys.argv[1:]):
        register()  # main_base hands the command line to the adapter, which trains here
        main_base.main()
        return
    import ray
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    @ray.remote(num_cpus=1)
    def skyrl_entrypoint(cfg):
        register()
        experiment(cfg).run()

    cfg = SkyRLTrainConfig.from_cli_overrides(sys.argv[1:])
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))
