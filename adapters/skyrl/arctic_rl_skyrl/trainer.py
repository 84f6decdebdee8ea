"""SkyRL's own experiment and trainer, with the policy's work delegated to the Arctic RL server.

`ArcticPPOExp` is SkyRL's `BasePPOExp` building the same tracker, inference client (SkyRL's
`RemoteInferenceClient` on the server's vLLM-compatible routes), generator (SkyRL-Gym's) and
trainer; only the models differ: `build_models` installs an `ArcticDispatch` where SkyRL would
start FSDP or Megatron workers, and its prompt data sets filter in at most as many processes as the
driver has cores (SkyRL's main_base asks 8, each a new interpreter). The trainer is SkyRL's
synchronous one, or with `trainer.fully_async.enabled=true` its fully asynchronous one (generation runs on while the
backend trains, weights synced after each step, staleness bounded by SkyRL). The training loop,
advantages, rewards, dynamic sampling and logging are SkyRL's code, unchanged.
"""

from __future__ import annotations

import os

import skyrl.train.entrypoints.main_base as main_base
from loguru import logger
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.fully_async_trainer import FullyAsyncRayPPOTrainer
from skyrl.train.trainer import RayPPOTrainer

from arctic_rl_core.client import ArcticRLClient
from arctic_rl_skyrl.dispatch import ArcticDispatch
from arctic_rl_skyrl.losses import uses_reference


def training_steps(cfg, total_training_steps: int | None, model: str = "policy") -> int | None:
    """Optimizer steps over the run, as SkyRL counts them for the schedule of `model` ("policy", "critic")."""
    if total_training_steps is None:
        return None
    mini_batch = getattr(cfg.trainer, f"{model}_mini_batch_size")
    return total_training_steps * (cfg.trainer.train_batch_size // mini_batch * cfg.trainer.update_epochs_per_batch)


class ArcticModels:
    """What either SkyRL trainer needs to train through the backend."""

    client: ArcticRLClient

    def build_models(self, PolicyWorker=None, CriticWorker=None, RefWorker=None):
        self.policy_model = self.critic_model = None
        # SkyRL asks for reference log-probs when it holds a reference model: the job's serves them. Its critic
        # (GAE) is the job's critic, which SkyRL reaches through the dispatch under "critic".
        self.ref_model = "the Arctic RL job's reference model" if uses_reference(self.cfg) else None
        self.dispatch = ArcticDispatch(self.cfg, self.client, training_steps(self.cfg, self.total_training_steps),
                                       training_steps(self.cfg, self.total_training_steps, "critic"))
        logger.info(f"policy training delegated to the Arctic RL server at {self.client.url}")

    def fwd_logprobs_values_reward(self, training_input):
        self.dispatch.expect_rows(training_input)
        return super().fwd_logprobs_values_reward(training_input)


class ArcticPPOTrainer(ArcticModels, RayPPOTrainer):
    pass


class ArcticFullyAsyncTrainer(ArcticModels, FullyAsyncRayPPOTrainer):
    pass


def prompt_filter_processes_patch():
    """SkyRL's main_base builds its prompt data sets with 8 filtering processes, whatever the machine: each is a new
    interpreter importing torch (about 9 CPU s), 75 CPU s per data set on a 2-core machine. At most the driver's
    cores; a cluster's head node with 8 or more keeps SkyRL's 8."""
    from arctic_rl_core.patches import Patch

    def make(original):
        def prompt_dataset(*args, num_workers: int = 8, **kwargs):
            return original(*args, num_workers=min(num_workers, len(os.sched_getaffinity(0))), **kwargs)

        return prompt_dataset

    return Patch(main_base, "PromptDataset", make, by=__name__,
                 reason="main_base's prompt data sets filter in at most as many processes as the driver has cores")


class ArcticPPOExp(BasePPOExp):
    def __init__(self, cfg, client: ArcticRLClient):
        with prompt_filter_processes_patch().applied():  # BasePPOExp builds its data sets as it starts
            super().__init__(cfg)
        self.client = client

    def get_trainer(self, *args, **kwargs) -> ArcticModels:
        cls = ArcticFullyAsyncTrainer if self.cfg.trainer.fully_async.enabled else ArcticPPOTrainer
        trainer = cls(*args, **kwargs)
        trainer.client = self.client
        return trainer

    def _setup_trainer(self) -> ArcticModels:
        """SkyRL's set-up (tracker, inference client, generator, trainer) without its model workers."""
        logger.info(self.get_cfg_as_str(self.cfg))
        os.makedirs(self.cfg.trainer.export_path, exist_ok=True)
        os.makedirs(self.cfg.trainer.ckpt_path, exist_ok=True)
        tracker = self.get_tracker()
        inference_client = self.get_inference_client()
        generator = self.get_generator(self.cfg, self.tokenizer, inference_client)
        trainer = self.get_trainer(cfg=self.cfg, tracker=tracker, tokenizer=self.tokenizer,
                                   train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                                   inference_engine_client=inference_client, generator=generator,
                                   colocate_pg=self.colocate_pg)
        trainer.trajectory_logger = self.get_trajectory_logger()
        self.trainer = trainer
        trainer.build_models()
        return trainer
