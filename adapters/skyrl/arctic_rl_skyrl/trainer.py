"""SkyRL's own experiment and trainer, with the policy's work delegated to the Arctic RL server.

`ArcticPPOExp` is SkyRL's `BasePPOExp` building the same tracker, inference client (SkyRL's
`RemoteInferenceClient` on the server's vLLM-compatible routes), generator (SkyRL-Gym's) and
trainer; only the models differ: `build_models` installs an `ArcticDispatch` where SkyRL would
start FSDP or Megatron workers, and its prompt data sets filter in no more processes than the driver's cores
and the prompts pay for (SkyRL's main_base asks 8, each a new interpreter). The trainer is SkyRL's
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


PROMPTS_PER_FILTER_PROCESS = 50_000
"""A filtering process is a new interpreter importing torch (about 9 CPU s); a prompt's chat template and
tokenization take about 0.14 ms (20,000 GSM8K-sized prompts, 2.8 CPU s): a process pays for itself past some
60,000 prompts."""


def local_prompts(datasets: str | list[str]) -> int | None:
    """The rows of a data set SkyRL reads from local Parquet or JSON-lines files, from the Parquet footers and the
    lines; None where a source is anything else (a Hub data set, a JSON array), whose size is known only once read."""
    rows = 0
    for source in [datasets] if isinstance(datasets, str) else datasets:
        kind = os.path.splitext(source)[-1].lower()
        if kind == ".parquet" and os.path.isfile(source):
            import pyarrow.parquet as pq

            rows += pq.read_metadata(source).num_rows
        elif kind == ".jsonl" and os.path.isfile(source):
            with open(source, "rb") as f:
                rows += sum(1 for line in f if line.strip())
        else:
            return None
    return rows


def filter_processes(datasets: str | list[str], asked: int) -> int:
    """The processes a prompt data set filters in: SkyRL's `asked`, at most the driver's cores and one per
    `PROMPTS_PER_FILTER_PROCESS` prompts counted (a Hub data set: the cores)."""
    processes = min(asked, len(os.sched_getaffinity(0)))
    rows = local_prompts(datasets)
    if rows is not None:
        processes = min(processes, -(-rows // PROMPTS_PER_FILTER_PROCESS))
    return max(processes, 1)


def prompt_filter_processes_patch():
    """SkyRL's main_base builds its prompt data sets with 8 filtering processes, whatever the machine and the data:
    75 CPU s per data set on a 2-core machine, for a few prompts as for millions. As many as the driver's cores and
    the prompts pay for (`filter_processes`); a cluster's head node with 8 or more cores keeps SkyRL's 8 for a data
    set of 350,000 prompts or more."""
    from arctic_rl_core.patches import Patch

    def make(original):
        def prompt_dataset(datasets, *args, num_workers: int = 8, **kwargs):
            return original(datasets, *args, num_workers=filter_processes(datasets, num_workers), **kwargs)

        return prompt_dataset

    return Patch(main_base, "PromptDataset", make, by=__name__,
                 reason="main_base's prompt data sets filter in as many processes as the driver's cores and the "
                        "prompts pay for")


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
