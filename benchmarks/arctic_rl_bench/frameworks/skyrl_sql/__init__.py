"""`bench frameworks`' workload as a SkyRL-Gym environment, and the entry point that registers it, as SkyRL documents a
custom environment (its own `main` registers the environment where the trainer's generator runs, then runs SkyRL's
`main_base`). Rewarded as the other frameworks' columns are: 1 for a reply holding the answer's first digit
(`workload.REWARD`), so a random model earns mixed rewards and its weights move.

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
        main_base.BasePPOExp(cfg).run()

    cfg = SkyRLTrainConfig.from_cli_overrides(sys.argv[1:])
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))
