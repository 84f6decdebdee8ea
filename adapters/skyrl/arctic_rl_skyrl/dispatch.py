"""What SkyRL's trainer drives in place of its `WorkerDispatch`: every call goes to the Arctic RL server.

SkyRL's `RayPPOTrainer` reaches training only through `self.dispatch`. This object answers the
same calls for the policy (`"policy"`): `forward` (old log-probs) is one `log_probs` call,
each mini-batch's `forward_backward_from_staged` one `fwd_bwd` with the mini-batch whole, so its
GRPO groups arrive together and ZoRRo computes each shared prompt once, and `optim_step` one
`step` at the learning rate of SkyRL's own schedule. `save_weights_for_sampler` is
`sync_weights`: the sampler SkyRL's generator talks to is the server's. SkyRL's critic (`"critic"`, for GAE)
is the job's critic: `forward` is `values`, each mini-batch one `fwd_bwd(model="critic")` with the value
loss of SkyRL's `ppo_critic_loss`, `optim_step` one `step(model="critic")` at the rate of the critic's
schedule. The weights live in the backend; this process holds none.

The metrics SkyRL logs (`policy/policy_loss`, `policy/loss_metrics/clip_ratio`, ...) are SkyRL's own
loss code evaluated, micro-batch by micro-batch as its worker would, on the log-probs of the
backend's own forward (`fwd_bwd` returns them: one forward per update); `policy/arctic_loss` is the
backend's value of the loss it took gradients of, for comparison with SkyRL's `final_loss`.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import torch

from arctic_rl_core import checkpoint_handles
from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_skyrl.batch import group_ids, response_lengths, right_aligned, sequences_from_batch
from arctic_rl_skyrl.losses import behaviour_key, critic_loss_spec, loss_spec, uses_critic
from arctic_rl_skyrl.replay import reference_replays, replays

SCORED = {"policy": "trainer", "ref": "reference"}
"""SkyRL's models the backend scores log-probs with, and where: the policy's current weights, the reference model."""


def lr_schedule(optim, num_training_steps: int | None):
    """SkyRL's learning-rate schedule, built by the same transformers function as its FSDP strategy, on a
    placeholder optimizer: it yields the learning rate of each step, which `step` sends to the backend."""
    from transformers import get_scheduler

    placeholder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optim.lr)
    return get_scheduler(optim.scheduler, placeholder, num_warmup_steps=optim.num_warmup_steps,
                         num_training_steps=num_training_steps)


def _advance(schedule) -> None:
    schedule.optimizer.step()  # a no-op (no gradients): the order torch expects before the schedule's step
    schedule.step()


def _find_rows(rows: torch.Tensor, wanted: torch.Tensor) -> list[int]:
    """Where each row of `wanted` is in `rows` (SkyRL forwards the whole batch, or a contiguous mini-batch of it)."""
    for start in range(rows.shape[0] - wanted.shape[0] + 1):
        if torch.equal(rows[start:start + wanted.shape[0]], wanted):
            return list(range(start, start + wanted.shape[0]))
    raise ArcticSetupError("SkyRL asked for log-probs of rows that are not in the batch it is preparing")


class ArcticDispatch:
    def __init__(self, cfg, client: ArcticRLClient, num_training_steps: int | None,
                 critic_training_steps: int | None = None):
        self.cfg = cfg
        self.client = client
        self.loss = loss_spec(cfg)
        self.behaviour_key = behaviour_key(cfg)
        self.temperature = cfg.trainer.algorithm.temperature or 1.0
        self.trained = ("policy", "critic") if uses_critic(cfg) else ("policy",)
        self.num_training_steps = {"policy": num_training_steps, "critic": critic_training_steps}
        self.schedules = {model: self._schedule(model) for model in self.trained}
        self.replaying = {"policy": replays(cfg), "ref": reference_replays(cfg), "critic": False}
        """Per model, whether its passes replay each row's recorded routing (R3)."""
        self._rows = None

    def _schedule(self, model: str):
        return lr_schedule(getattr(self.cfg.trainer, model).optimizer_config, self.num_training_steps[model])

    def expect_rows(self, training_input) -> None:
        """The batch whose log-probs SkyRL is about to ask for: its forward passes carry only the token rows
        and the response width, not where each prompt ends or which group a row is in."""
        self._rows = (training_input["sequences"], response_lengths(training_input), group_ids(training_input))

    def _row_layout(self, data) -> tuple[list[int], list[str | None]]:
        if data.get("response_mask") is not None:
            return response_lengths(data), group_ids(data)
        if self._rows is None:
            raise ArcticSetupError("SkyRL asked for log-probs of a batch without its response mask")
        rows, lengths, groups = self._rows
        index = _find_rows(rows, data["sequences"])
        return [lengths[i] for i in index], [groups[i] for i in index]

    def _check_trained(self, model: str) -> None:
        if model not in self.trained:
            raise ArcticSetupError(f"SkyRL asked the Arctic RL backend to train its {model!r} model; it trains "
                                   f"{' and '.join(self.trained)} here")

    # -- placement: the backend places and offloads itself -----------------------------------------------

    def get_lcm_dp_size(self) -> int:
        return 1  # one SkyRL-side worker per job: mini-batches go whole, the backend shards them

    def dp_size(self, model: str) -> int:
        return 1

    def get_node_ids(self) -> list[str]:
        return []  # SkyRL's checkpoint folders are on this machine only (the weights are the server's)

    def mark_all_offloaded(self) -> None:
        pass

    def empty_cache(self, model: str | None = None) -> None:
        pass

    def init_weight_sync_state(self, inference_engine_client) -> None:
        pass  # the sampler SkyRL's client talks to is the server's: sync_weights reaches it

    def get_timing_metrics(self) -> dict[str, float]:
        return {}

    def start_profile(self, model: str, config=None, raise_on_error: bool = False) -> None:
        pass

    def profile_step(self, model: str):
        return None

    def stop_profile(self, model: str, raise_on_error: bool = False) -> None:
        pass

    def init_model(self, model: str, model_path: str, num_training_steps: int | None = None) -> None:
        raise ArcticSetupError(f"SkyRL asked to (re)load its {model!r} model from {model_path}: the Arctic RL job "
                               "loads its model at start-up (arctic-rl serve)")

    # -- compute ---------------------------------------------------------------------------------------------

    def forward(self, model: str, data, loss_fn=None, loss_fn_config=None, model_id=None):
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput

        served = (*SCORED, "critic") if "critic" in self.trained else tuple(SCORED)
        if model not in served:
            raise ArcticSetupError(f"SkyRL asked the Arctic RL backend for its {model!r} model; it serves "
                                   f"{', '.join(served)}")
        if loss_fn is not None:
            raise ArcticSetupError(f"loss_fn={loss_fn!r}: the Arctic RL dispatch serves SkyRL's PPO trainer, whose "
                                   "forward passes take no loss")
        lengths, groups = self._row_layout(data)
        sequences = sequences_from_batch(data, groups, lengths=lengths, replay=self.replaying[model])
        width = data.metadata["response_length"]
        if model == "critic":
            rows = right_aligned(self.client.values(sequences).values, width)
            return WorkerOutput(loss_fn_outputs=[{"values": row.tolist()} for row in rows], metrics={})
        scored = self.client.log_probs(sequences, temperature=self.temperature, source=SCORED[model])
        rows = right_aligned(scored.logprobs, width)
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in rows], metrics={})

    def stage_data(self, model: str, data, mini_batch_boundaries) -> list:
        """The mini-batches, each with its GRPO groups (SkyRL's prompt boundaries, rebased to the mini-batch)."""
        self._check_trained(model)
        prompts = data.metadata.get("policy_prompt_boundaries") or []
        staged = []
        for start, end in mini_batch_boundaries:
            chunk = data[start:end]
            local = [(s - start, e - start) for s, e in prompts if start <= s < end]
            staged.append((chunk, group_ids(chunk, local)))
        return staged

    def forward_from_staged(self, model: str, chunk, loss_fn=None, loss_fn_config=None, model_id=None):
        return self.forward(model, chunk[0], loss_fn, loss_fn_config, model_id)

    def forward_backward(self, model: str, data, loss_fn=None, loss_fn_config=None, model_id=None):
        prompts = data.metadata.get("policy_prompt_boundaries")
        return self.forward_backward_from_staged(model, (data, group_ids(data, prompts)), loss_fn, loss_fn_config)

    def forward_backward_from_staged(self, model: str, chunk, loss_fn=None, loss_fn_config=None, model_id=None):
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput

        self._check_trained(model)
        if loss_fn is not None or loss_fn_config:
            raise ArcticSetupError("a per-call loss_fn: the Arctic RL dispatch trains with trainer.algorithm's loss")
        data, groups = chunk
        if model == "critic":
            return self._critic_forward_backward(data, groups)
        sequences = sequences_from_batch(data, groups, self.behaviour_key, replay=self.replaying["policy"])
        result = self.client.fwd_bwd(sequences, self.loss, return_logprobs=True, with_entropy=True)
        metrics = self._skyrl_metrics(data, result.logprobs, result.entropy)
        # The backend's own value of the loss it took gradients of, and how it computed the mini-batch: groups
        # whole (each shared prompt once) is what `arctic_computed_tokens` below the rows' total length shows.
        metrics.update(arctic_loss=result.loss, arctic_groups=float(len(set(groups))),
                       arctic_computed_tokens=float(result.computed_tokens),
                       arctic_row_tokens=float(sum(len(s.prompt_ids) + len(s.response_ids) for s in sequences)),
                       arctic_replayed_sequences=float(sum(s.routed_experts is not None for s in sequences)))
        return WorkerOutput(loss_fn_outputs=[{"logprobs": lp} for lp in result.logprobs], metrics=metrics)

    def _per_micro_batch(self, rows: int, status) -> dict[str, list[float]]:
        """`status(start, end)` of each of SkyRL's micro-batches over `rows`, as its worker splits them, by key."""
        micro = self.cfg.trainer.micro_train_batch_size_per_gpu
        collected: dict[str, list[float]] = defaultdict(list)
        for start in range(0, rows, micro):
            for key, value in status(start, min(start + micro, rows)).items():
                collected[key].append(value)
        return dict(collected)

    def _critic_forward_backward(self, data, groups):
        """One mini-batch of SkyRL's critic update; its metrics are SkyRL's own `ppo_critic_loss` evaluated, micro-batch
        by micro-batch, on the values of the backend's forward."""
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
        from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_critic_loss
        from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
        from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics

        sequences = sequences_from_batch(data, groups, critic=True)
        result = self.client.fwd_bwd(sequences, critic_loss_spec(self.cfg), model="critic")
        values_all = right_aligned(result.values, data["response_mask"].shape[1])

        def status(start: int, end: int) -> dict[str, float]:
            mb, values = data[start:end], values_all[start:end]
            loss, clipfrac = ppo_critic_loss(values, mb["values"], mb["returns"], config=self.cfg.trainer.algorithm,
                                             loss_mask=mb["loss_mask"])
            return {"critic_loss": float(loss), "values_mean": float(masked_mean(values, mb["loss_mask"])),
                    "values_clipfrac": clipfrac, "critic_lr": self.schedules["critic"].get_last_lr()[0]}

        metrics = reduce_metrics(self._per_micro_batch(len(data), status))
        metrics.update(arctic_loss=result.loss, arctic_groups=float(len(set(groups))))
        return WorkerOutput(loss_fn_outputs=[{"values": v} for v in result.values], metrics=metrics)

    def _skyrl_metrics(self, data, logprobs: list[list[float]], entropy: list[list[float]]) -> dict[str, float]:
        """SkyRL's worker metrics for this mini-batch, from SkyRL's own functions over its micro-batches."""
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry, compute_approx_kl
        from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
        from skyrl.backends.skyrl_train.workers.worker_utils import (
            compute_minibatch_rollout_logprob_diff_metrics,
            reduce_metrics,
        )

        algorithm = self.cfg.trainer.algorithm
        loss_fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
        width = data["response_mask"].shape[1]
        logp_all, entropy_all = right_aligned(logprobs, width), right_aligned(entropy, width)
        rows = len(data)

        def status(start: int, end: int) -> dict[str, float]:
            mb = data[start:end]
            logp, mask, rollout = logp_all[start:end], mb["loss_mask"], mb.get("rollout_logprobs")
            with torch.no_grad():
                policy_loss, loss_metrics = loss_fn(logp, mb["action_log_probs"], mb["advantages"], config=algorithm,
                                                    loss_mask=mask, rollout_logprobs=rollout)
                mb_entropy = masked_mean(entropy_all[start:end], mask)
            bonus = mb_entropy * algorithm.entropy_loss_coef if algorithm.use_entropy_loss else torch.tensor(0.0)
            kl = torch.tensor(0.0)
            if algorithm.use_kl_loss:
                kl = masked_mean(compute_approx_kl(logp, mb["base_action_log_probs"], loss_mask=mask,
                                                   kl_estimator_type=algorithm.kl_estimator_type), mask, dim=-1).mean()
            penalties = kl * algorithm.kl_loss_coef - bonus
            out = {"final_loss": float(policy_loss + penalties * (end - start) / rows),
                   "policy_loss": float(policy_loss), "policy_entropy": float(mb_entropy),
                   "response_length": width, "policy_lr": self.schedules["policy"].get_last_lr()[0]}
            out.update({f"loss_metrics/{k}": v for k, v in loss_metrics.items()})
            if algorithm.use_kl_loss:
                out["policy_kl"] = float(kl)
            out.update(compute_minibatch_rollout_logprob_diff_metrics(logp, rollout, mask))
            return out

        return reduce_metrics(self._per_micro_batch(rows, status), sum_loss_metrics=True)

    def optim_step(self, model: str, model_id=None) -> float | None:
        self._check_trained(model)
        grad_norm = self.client.step(self.schedules[model].get_last_lr()[0], model=model).grad_norm
        _advance(self.schedules[model])
        return grad_norm

    # -- weights and checkpoints stay in the backend ---------------------------------------------------------

    async def save_weights_for_sampler(self, model_id=None) -> None:
        await asyncio.to_thread(self.client.sync_weights)

    def save_checkpoint(self, model: str, ckpt_dir: str, tokenizer=None, model_id=None) -> None:
        """The server saves under its own checkpoint folder; SkyRL's folder records which checkpoint that is, so
        save and resume work whether or not the two machines share a disk. Each record restores the whole job
        (policy and critic); its schedule position is `model`'s."""
        self._check_trained(model)
        # The schedule's own position: the job's step count also holds steps taken outside this run.
        checkpoint_handles.save(self.client, "skyrl", ckpt_dir, schedule_steps=self.schedules[model].last_epoch,
                                server=self.client.url)

    def finalize_pending_saves(self, model: str) -> None:
        pass  # the server's save has returned when the call does

    def load_checkpoint(self, model: str, ckpt_dir: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, model_id=None) -> None:
        self._check_trained(model)
        try:  # without its optimizer state: the weights, with a fresh optimizer
            record = checkpoint_handles.load(self.client, ckpt_dir, optimizer=load_optimizer_states)
        except checkpoint_handles.NoCheckpointRecord as err:
            raise ArcticSetupError(str(err)) from None
        self.schedules[model] = self._schedule(model)
        if load_lr_scheduler_states:
            for _ in range(record["schedule_steps"]):  # the schedule continues where it was saved
                _advance(self.schedules[model])

    def save_hf_model(self, model: str, export_dir: str, tokenizer) -> None:
        raise ArcticSetupError("trainer.hf_save_interval: the weights are the Arctic RL server's; export them from "
                               "its checkpoints (save_checkpoint) instead")
