"""verl's training engine `arctic_rl`: every call goes to an Arctic RL server through the thin client.

verl's `TrainingWorker` drives it exactly as it drives its FSDP engine:
`forward_backward_batch` (log-probs for `compute_log_prob`, or the actor update),
`optimizer_step`, checkpoints. The weights live in the backend; this process holds none.

Actor update: the whole mini-batch goes to the backend in one `fwd_bwd` call, so GRPO
groups (verl's `uid`) arrive whole and ZoRRo computes each shared prompt once. The call
returns the log-probs (and entropy) of its own forward, and verl's own loss function is
evaluated on them (no gradient), so the metrics verl reports (`actor/pg_loss`,
`actor/pg_clipfrac`, `actor/ppo_kl`, ...) are verl's, from one forward per update;
`arctic/loss` is the backend's own value for the same loss, for comparison.

verl's reference worker builds this engine `forward_only`: it then scores with the job's frozen
reference model (`log_probs(source="reference")`) for verl's KL terms, and never trains.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from arctic_rl_core import checkpoint_handles
from arctic_rl_verl import trace
from arctic_rl_verl.batch import (batch_temperature, full_row_layout, full_row_routes, loss_spec, sequences_from_batch,
                                  value_loss_spec)
from arctic_rl_verl.connect import ArcticSetupError, connect, connect_critic, connect_reference

logger = logging.getLogger(__name__)


def lr_schedule(optim) -> torch.optim.lr_scheduler.LambdaLR:
    """verl's learning-rate schedule for these settings, built by verl's own functions as its FSDP engine builds it,
    on a placeholder optimizer: it yields the learning rate of each step, which `step` sends to the backend."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    placeholder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * optim.total_training_steps)
    kind = getattr(optim, "lr_scheduler_type", "constant")
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=placeholder, num_warmup_steps=warmup)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer=placeholder, num_warmup_steps=warmup, num_training_steps=optim.total_training_steps,
            min_lr_ratio=getattr(optim, "min_lr_ratio", None) or 0.0, num_cycles=getattr(optim, "num_cycles", 0.5),
            zero_indexed_step=getattr(optim, "zero_indexed_step", True))
    raise ValueError(f"actor_rollout_ref.actor.optim.lr_scheduler_type={kind!r}: verl knows constant and cosine")


@EngineRegistry.register(model_type="language_model", backend="arctic_rl", device=["cuda", "npu", "cpu"])
class ArcticRLEngine(BaseEngine):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **kwargs):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.client = None
        self.mode = None
        self.reference = False
        """verl's ref worker (`forward_only`): scores with the job's reference model, never trains."""

    def initialize(self):
        self.reference = bool(getattr(self.engine_config, "forward_only", False))
        if self.reference:
            # verl's ref worker (use_kl_loss / use_kl_in_reward): log-probs of the job's frozen reference model.
            self.client = connect_reference(self.engine_config, self.model_config)
            return
        workers = self.get_data_parallel_size()
        if workers > 1:
            # Each worker would send its shard of a mini-batch as its own fwd_bwd and step: groups split, and as
            # many optimizer steps per mini-batch as workers.
            raise ArcticSetupError(f"verl runs {workers} actor workers (trainer.n_gpus_per_node x trainer.nnodes): "
                                   "arctic_rl serves one, which sends each mini-batch whole; the backend parallelises "
                                   "itself (engine.ranks, sampler.replicas). Set trainer.n_gpus_per_node=1 "
                                   "trainer.nnodes=1")
        self.client = connect(self.engine_config, self.model_config, self.optimizer_config)
        self.schedule = lr_schedule(self.optimizer_config)  # from its start, as verl's own engine (a resume moves it)

    # -- no local parameters, nothing to offload -----------------------------------------------------

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model, optimizer, grad)

    # -- one verl rank per backend: the backend shards internally --------------------------------------

    def get_data_parallel_rank(self):
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def get_data_parallel_size(self):
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def get_data_parallel_group(self):
        # Not None: verl gathers per-rank metrics over this group before flattening them.
        return torch.distributed.group.WORLD

    def is_mp_src_rank_with_outputs(self):
        return True

    # -- compute -----------------------------------------------------------------------------------------

    @property
    def router_replay(self) -> str:
        """verl's `router_replay.mode` on this engine's config: disabled, R2 or R3."""
        replay = getattr(self.engine_config, "router_replay", None)
        return "disabled" if replay is None else replay.mode

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        started = time.perf_counter()
        # The policy's passes replay the batch's routes (R3: the rollout's; R2: the old-log-prob pass's), the
        # reference's do not (verl replays the actor only).
        replaying = self.router_replay != "disabled" and not self.reference
        sequences = sequences_from_batch(data, routes=replaying)
        temperature = batch_temperature(data)
        with_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        update = loss_function is not None and not forward_only
        call_started = time.perf_counter()
        if update:
            # One forward: fwd_bwd returns the log-probs it took gradients at, which verl's loss reads for its metrics.
            scored = result = self.client.fwd_bwd(sequences, loss_spec(loss_function.keywords["config"], temperature),
                                                  return_logprobs=True, with_entropy=with_entropy)
        else:
            result = None
            scored = self.client.log_probs(sequences, with_entropy=with_entropy, temperature=temperature,
                                           source="reference" if self.reference else "trainer")
        call_s = time.perf_counter() - call_started
        model_output = {"log_probs": full_row_layout(scored.logprobs, data)}
        if with_entropy:
            model_output["entropy"] = full_row_layout(scored.entropy, data)
        if replaying and not update and self.router_replay == "R2":
            # R2: the old-log-prob pass's routing, which verl carries into the update's batch.
            model_output["routed_experts"] = full_row_routes(scored.routed_experts, data)
        output = self._with_verls_loss(model_output, data, loss_function, result, sequences)
        trace.record("fwd_bwd" if update else "reference_log_probs" if self.reference else "log_probs",
                     rows=len(sequences), adapter_s=time.perf_counter() - started, call_s=call_s)
        return output

    def _with_verls_loss(self, model_output: dict, data: TensorDict, loss_function: Callable | None, result,
                         sequences) -> dict:
        """verl's own loss evaluated (no gradient) on the backend's outputs, for the metrics verl logs; with an
        update's `result`, the backend's own loss beside it (`arctic/loss`)."""
        metrics: dict = {}
        losses = [0.0]
        if loss_function is not None:
            # verl's loss reads the mini-batch's token count and data-parallel size from the batch.
            tu.assign_non_tensor(data, batch_num_tokens=float(data["loss_mask"].sum()), dp_size=self.get_data_parallel_size())
            with torch.no_grad():
                verl_loss, verl_metrics = loss_function(model_output=model_output, data=data,
                                                        dp_group=self.get_data_parallel_group())
            append_to_dict(metrics, verl_metrics)
            losses = [float(verl_loss)]
            if result is not None:
                append_to_dict(metrics, {"arctic/loss": result.loss, "arctic/num_tokens": float(result.num_tokens),
                                         "arctic/groups": float(len({s.group_id for s in sequences})),
                                         "arctic/replayed_sequences": float(sum(s.routed_experts is not None
                                                                                for s in sequences))})
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    def optimizer_zero_grad(self):
        pass  # the backend's gradients are zeroed by its own step

    def optimizer_step(self):
        return self.client.step(self.schedule.get_last_lr()[0]).grad_norm

    def lr_scheduler_step(self):
        self.schedule.step()
        return self.schedule.get_last_lr()[0]

    # -- weights stay in the backend -----------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs):
        # Nothing to ship: the rollout's update_weights asks the backend to sync_weights itself.
        return iter(()), None

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        # The server saves under its own checkpoint folder; verl's folder records which checkpoint, and where
        # verl's schedule was (the job's step count also holds steps taken outside this run). No shared disk needed.
        checkpoint_handles.save(self.client, "verl", local_path, schedule_steps=self.schedule.last_epoch)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        try:
            record = checkpoint_handles.load(self.client, local_path)
        except checkpoint_handles.NoCheckpointRecord as err:
            raise ArcticSetupError(str(err)) from None
        self.schedule = lr_schedule(self.optimizer_config)
        for _ in range(record["schedule_steps"]):  # the schedule continues where it was saved
            self.schedule.optimizer.step()  # a no-op (no gradients): the order torch expects
            self.schedule.step()


@EngineRegistry.register(model_type="value_model", backend="arctic_rl", device=["cuda", "npu", "cpu"])
class ArcticRLCriticEngine(ArcticRLEngine):
    """verl's critic (PPO with GAE) on the job's critic: `compute_values` reads `values`, `update_critic` sends
    each mini-batch whole as one `fwd_bwd(model="critic")` with the value loss of verl's critic settings, which
    returns the values of its own forward for verl's `value_loss` metrics; `step(model="critic")` at the rate
    of verl's `critic.optim` schedule."""

    def initialize(self):
        self.reference = False
        workers = self.get_data_parallel_size()
        if workers > 1:
            raise ArcticSetupError(f"verl runs {workers} critic workers (trainer.n_gpus_per_node x trainer.nnodes): "
                                   "arctic_rl serves one. Set trainer.n_gpus_per_node=1 trainer.nnodes=1")
        self.client = connect_critic(self.engine_config, self.model_config, self.optimizer_config)
        self.schedule = lr_schedule(self.optimizer_config)

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        started = time.perf_counter()
        update = loss_function is not None and not forward_only
        sequences = sequences_from_batch(data, critic=update)
        call_started = time.perf_counter()
        if update:
            result = self.client.fwd_bwd(sequences, value_loss_spec(loss_function.keywords["config"]), model="critic")
            values = result.values
        else:
            result, values = None, self.client.values(sequences).values
        call_s = time.perf_counter() - call_started
        output = self._with_verls_loss({"values": full_row_layout(values, data)}, data, loss_function, result, sequences)
        trace.record("critic_fwd_bwd" if update else "values", rows=len(sequences),
                     adapter_s=time.perf_counter() - started, call_s=call_s)
        return output

    def optimizer_step(self):
        return self.client.step(self.schedule.get_last_lr()[0], model="critic").grad_norm
