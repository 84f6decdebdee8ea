"""The adapter's settings inside verl's config: an `arctic` block on the actor (and the ref/critic).

Selected by the yaml files in `conf/` through their `_target_`s (`model_engine=arctic_rl`,
or the primary config `arctic_ppo_trainer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config import ActorConfig, CriticConfig
from verl.workers.config.engine import EngineConfig

from arctic_rl_verl.batch import loss_spec, value_loss_spec


@dataclass
class ArcticEngineConfig(EngineConfig):
    strategy: str = "arctic_rl"
    url: Optional[str] = None
    """The Arctic RL server (`arctic-rl serve`), e.g. http://trainer-host:7000."""
    token_env: str = "ARCTIC_RL_TOKEN"
    """Environment variable holding the server's bearer token (needed off loopback)."""
    timeout_s: float = 600.0
    model_path: Optional[str] = None
    """The model folder as the server sees it; default: actor_rollout_ref.model.path."""
    job: Optional[dict[str, Any]] = None
    """Backend settings (`engine`, `sampler`, `zorro`) used to initialize a server that runs no job yet. None in
    the yaml, so `arctic.job={engine: {...}, sampler: {...}}` sets it whole (an empty dict would be a struct)."""

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "arctic_rl":
            raise ValueError(f"actor_rollout_ref.actor.arctic.strategy must be arctic_rl, got {self.strategy!r}")


@dataclass
class ArcticActorConfig(ActorConfig):
    strategy: str = "arctic_rl"
    arctic: ArcticEngineConfig = field(default_factory=ArcticEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        self.engine = self.arctic  # TrainingWorker builds the engine from ActorConfig.engine
        loss_spec(self, temperature=1.0)  # a loss setting we cannot honour stops the run here, before any rollout


@dataclass
class ArcticCriticConfig(CriticConfig):
    """verl's critic (GAE) on the job's critic (`critic.enable` in the server's job): values and value-loss
    updates go to the server, at `critic.arctic.url` (default: the actor's server)."""

    strategy: str = "arctic_rl"
    arctic: ArcticEngineConfig = field(default_factory=ArcticEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        self.engine = self.arctic  # TrainingWorker builds the engine from CriticConfig.engine
        value_loss_spec(self)  # a loss setting we cannot honour stops the run here, before any rollout
