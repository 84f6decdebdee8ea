"""`trainer.override_entrypoint=arctic_rl_skyrl.entrypoint`: SkyRL's `main_base` hands its command line here.

Every setting is checked before anything starts (SkyRL's own validation, then what the backend
would not honour, then the server and its job), so a bad configuration fails in seconds, by name.
SkyRL's trainer runs in this process (SkyRL's own entry point runs it as a Ray task on a GPU
node; here it needs none): the GPU work is the server's.
"""

from __future__ import annotations

import sys

from arctic_rl_skyrl.connect import check_inference, connect
from arctic_rl_skyrl.losses import check_algorithm
from arctic_rl_skyrl.replay import check_router_replay
from arctic_rl_skyrl.settings import split_overrides


def main(argv: list[str] | None = None) -> None:
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    from arctic_rl_skyrl.trainer import ArcticPPOExp

    settings, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    cfg = SkyRLTrainConfig.from_cli_overrides(overrides)
    validate_cfg(cfg)
    check_algorithm(cfg)
    check_router_replay(cfg)
    check_inference(cfg, settings)
    client = connect(cfg, settings)
    initialize_ray(cfg)  # SkyRL's trainer and generator use Ray (metrics, registries) even with no GPU workers
    ArcticPPOExp(cfg, client).run()


if __name__ == "__main__":
    main()
