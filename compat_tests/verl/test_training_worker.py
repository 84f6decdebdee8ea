"""verl's own TrainingWorker (verl.workers.engine_workers) driving the `arctic_rl` engine.

verl's worker computes log-probs (its `compute_log_prob` path) and runs an actor update
(`train_mini_batch`, with verl's `ppo_loss`) through our engine, which calls the Arctic RL
server. Checked: the log-probs are the backend's; the policy-loss metrics verl reports equal
verl's own loss code on the same inputs; the backend's GRPO loss equals verl's; the weights
change; GRPO groups reach the backend whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest
import torch

for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
    os.environ.setdefault(key, value)
# This process is a verl worker of a run that selected the arctic-rl backend (what the
# arctic_ppo_trainer config marks in every Ray worker's environment).
os.environ["ARCTIC_RL_VERL_BACKEND"] = "arctic-rl"

import verl  # noqa: E402,F401  (loads the arctic_rl plugin through verl's entry point)
from tensordict import NonTensorStack, TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, HFModelConfig, OptimizerConfig, TrainingWorkerConfig  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from arctic_rl_verl.batch import full_row_layout  # noqa: E402
from arctic_rl_verl.config import ArcticEngineConfig  # noqa: E402
from arctic_rl_verl.connect import ArcticSetupError  # noqa: E402
from arctic_rl_core.types import Sequence  # noqa: E402

from conftest import free_port, make_model, run_python  # noqa: E402

GROUPS, G = 3, 4


@pytest.fixture(scope="module", autouse=True)
def rendezvous():
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def worker_for(model_path: str, url: str, model_type: str = "language_model", router_replay: str = "disabled",
               **optim) -> TrainingWorker:
    """verl's TrainingWorker on the arctic_rl engine: the actor's (`language_model`) or the critic's (`value_model`)."""
    from verl.workers.config.engine import EngineRouterReplayConfig

    engine = ArcticEngineConfig(url=url, use_dynamic_bsz=False, micro_batch_size_per_gpu=4,
                                infer_micro_batch_size_per_gpu=4,
                                router_replay=EngineRouterReplayConfig(mode=router_replay))
    config = TrainingWorkerConfig(model_type=model_type, model_config=HFModelConfig(path=model_path, use_remove_padding=True),
                                  engine_config=engine, optimizer_config=OptimizerConfig(**{"lr": 1e-2, "clip_grad": 1.0, **optim}),
                                  checkpoint_config=CheckpointConfig())
    worker = TrainingWorker(config=config)
    worker.reset()
    return worker


def grpo_batch(tokenizer) -> TensorDict:
    """GROUPS prompts x G responses in verl's no-padding layout, groups interleaved (as verl may order them)."""
    torch.manual_seed(0)
    rows = []
    for s in range(G):
        for g in range(GROUPS):
            prompt = torch.tensor(tokenizer.encode(f"question {g}: what is {g} plus {g + 1}? answer:"))
            response = torch.randint(5, len(tokenizer), (3 + s + g,))
            rows.append(dict(prompts=prompt, responses=response, input_ids=torch.cat([prompt, response]),
                             position_ids=torch.arange(len(prompt) + len(response)),
                             response_mask=torch.ones(len(response), dtype=torch.int64), uid=f"uid-{g}"))
    nested = lambda key: torch.nested.as_nested_tensor([r[key] for r in rows], layout=torch.jagged)  # noqa: E731
    td = TensorDict({k: nested(k) for k in ("prompts", "responses", "input_ids", "position_ids", "response_mask")},
                    batch_size=[len(rows)])
    td["loss_mask"] = nested("response_mask")
    td["uid"] = NonTensorStack(*[r["uid"] for r in rows])
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, compute_loss=False)
    return td


def rounding_bound(loss_fn, served: list[list[float]], data: TensorDict, key: str = "log_probs") -> float:
    """How far the loss the backend differentiated may sit from verl's loss on the served `key` values.

    The backend's fwd_bwd computes its own log-probs, equal to the served ones up to fp32 rounding, and sums the
    loss's per-token terms in its own order. Both errors are a few ulps at the log-probs' scale per token, so the
    two losses agree within 8 ulps of the largest |log-prob| times sum |d loss / d log-prob| (first order). A fixed
    relative bound measured the CPU instead: DRO's loss (A*logp + a square) is ~1e3 times smaller than its terms.
    """
    flat = full_row_layout(served, data)
    leaf = flat.values().clone().requires_grad_()
    jagged = torch.nested.nested_tensor_from_jagged(leaf, offsets=flat.offsets())
    loss, _ = loss_fn(model_output={key: jagged}, data=data)
    loss.backward()
    ulps = 8 * torch.finfo(torch.float32).eps * max(abs(v) for row in served for v in row)
    return float(ulps * max(1.0, float(leaf.grad.abs().sum())))


def as_float(value) -> float:
    """A metric as verl reports it (a float, a one-element list, a tensor or a verl Metric)."""
    if isinstance(value, list):
        assert len(value) == 1, value
        return as_float(value[0])
    if hasattr(value, "aggregate"):
        return float(value.aggregate())
    return float(value)


def response_nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# verl's token probabilities on the tiny model are ~1e-3, so DPPO's bounds on a probability's move are set to that scale.
DPPO_BOUNDS = {"clip_ratio_low": 2e-4, "clip_ratio_high": 2e-4}
BYPASS_REINFORCE = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5}


@pytest.mark.parametrize("loss_mode, agg, settings", [
    ("vanilla", "token-mean", {}), ("gspo", "seq-mean-token-mean", {}), ("vanilla", "token-sum", {}),
    ("cispo", "token-mean", {}), ("gpg", "seq-mean-token-sum", {}), ("geo_mean", "token-mean", {}),
    ("sapo", "token-mean", {}), ("vanilla", "seq-mean-token-sum-norm", {"loss_scale_factor": 16}),
    ("dro", "token-mean", {"dro_beta": 0.3}), ("dppo_tv", "token-mean", DPPO_BOUNDS),
    ("dppo_kl", "seq-mean-token-mean", DPPO_BOUNDS), ("bypass_mode", "token-mean", {"rollout_correction": {}}),
    ("bypass_mode", "seq-mean-token-sum", {"rollout_correction": BYPASS_REINFORCE}),
    # verl's rollout correction in decoupled mode: per-token weights its trainer put in the batch.
    ("vanilla", "token-mean", {"rollout_is_weights": True}),
])
def test_training_worker_log_probs_and_actor_update_through_arctic_rl(tiny_model, server, client, loss_mode, agg,
                                                                       settings):
    from transformers import AutoTokenizer
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    worker = worker_for(tiny_model, server)
    settings = dict(settings)
    weighted = settings.pop("rollout_is_weights", False)
    policy = {key: settings.pop(key) for key in ("dro_beta", "rollout_correction") if key in settings}
    if "rollout_correction" in policy:
        policy["rollout_correction"] = RolloutCorrectionConfig(**policy["rollout_correction"])
    actor = ActorConfig(strategy="arctic_rl", rollout_n=G, ppo_mini_batch_size=GROUPS, ppo_micro_batch_size_per_gpu=4,
                        **{"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, **settings}, use_kl_loss=False,
                        loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy))
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    td = grpo_batch(tokenizer)
    sequences = [Sequence(prompt_ids=p.tolist(), response_ids=r.tolist())
                 for p, r in zip(td["prompts"].unbind(), td["responses"].unbind())]

    # compute_log_prob: verl's worker -> our engine -> the server's trainer.
    out = worker.infer_batch(td.clone())
    expected = client.log_probs(sequences, with_entropy=True)
    got = out["log_probs"]
    for row, exp, p, r in zip(got.unbind(), expected.logprobs, td["prompts"].unbind(), td["responses"].unbind()):
        assert torch.allclose(row[len(p) - 1 : len(p) - 1 + len(r)], torch.tensor(exp), atol=1e-6)
    assert out["entropy"].is_nested

    # update_actor inputs: stale old log-probs (so ratios spread over the clip range, per token and per sequence) and
    # mixed-sign advantages.
    old = [torch.tensor(lp) + torch.linspace(-0.4, 0.4, len(lp)) + float(shift)
           for lp, shift in zip(expected.logprobs, torch.linspace(0.3, -0.3, len(expected.logprobs)))]
    advantages = [torch.full((len(lp),), float(a)) for lp, a in zip(expected.logprobs, torch.linspace(-1.5, 1.5, len(old)))]
    td["old_log_probs"] = response_nested(old)
    td["advantages"] = response_nested(advantages)
    if weighted:
        td["rollout_is_weights"] = response_nested([torch.linspace(0.2, 2.0, len(lp)) for lp in expected.logprobs])
    tu.pop(td, "compute_loss")
    tu.assign_non_tensor(td, global_batch_size=len(old), mini_batch_size=len(old), epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False)

    # verl's own loss code on the same inputs, with the backend's current log-probs.
    reference = td.clone()
    tu.assign_non_tensor(reference, batch_num_tokens=float(reference["loss_mask"].sum()), dp_size=1)
    verl_loss, verl_metrics = ppo_loss(actor, model_output={"log_probs": full_row_layout(expected.logprobs, reference)},
                                       data=reference)
    bound = rounding_bound(partial(ppo_loss, actor), expected.logprobs, reference)

    digest = client.state_digest()
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    value = lambda key: as_float(metrics[key])  # noqa: E731
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        if key in verl_metrics:  # gpg reports no clip statistics: it has no clip
            assert value(key) == pytest.approx(as_float(verl_metrics[key]), rel=1e-5, abs=bound), key
    if "actor/pg_clipfrac" in verl_metrics and loss_mode not in ("gpg", "sapo"):  # a plain gradient, a soft gate
        assert 0 < value("actor/pg_clipfrac") < 1  # the clip range (DPPO: its bound) was exercised
    # Arctic RL's GRPO loss (what the backend differentiated) equals verl's vanilla PPO loss.
    assert value("arctic/loss") == pytest.approx(float(verl_loss), rel=1e-5, abs=bound)
    assert value("arctic/groups") == GROUPS  # every group arrived whole, in one fwd_bwd call
    assert value("grad_norm") > 0
    assert client.state_digest() != digest  # the backend's weights changed
    after = client.log_probs(sequences).logprobs
    assert max(abs(a - b) for x, y in zip(after, expected.logprobs) for a, b in zip(x, y)) > 1e-4


def test_kl_loss_trains_against_the_jobs_reference_model(tiny_model, server, client):
    """verl's ref worker (a forward-only engine) reads the job's reference model; the actor update's KL term is
    verl's: the loss the backend differentiated equals verl's ppo_loss with use_kl_loss on the same inputs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ref_engine = ArcticEngineConfig(url=server, forward_only=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=4,
                                    infer_micro_batch_size_per_gpu=4)
    ref_worker = TrainingWorker(config=TrainingWorkerConfig(
        model_type="language_model", model_config=HFModelConfig(path=tiny_model, use_remove_padding=True),
        engine_config=ref_engine, optimizer_config=OptimizerConfig(lr=1e-2), checkpoint_config=CheckpointConfig()))
    ref_worker.reset()
    td = grpo_batch(tokenizer)
    sequences = [Sequence(prompt_ids=p.tolist(), response_ids=r.tolist())
                 for p, r in zip(td["prompts"].unbind(), td["responses"].unbind())]
    out = ref_worker.infer_batch(td.clone())["log_probs"]
    ref = [row[len(p) - 1 : len(p) - 1 + len(r)] for row, p, r in zip(out.unbind(), td["prompts"].unbind(), td["responses"].unbind())]
    served = client.log_probs(sequences, source="reference").logprobs
    assert all(torch.allclose(a, torch.tensor(b), atol=1e-6) for a, b in zip(ref, served))

    worker = worker_for(tiny_model, server)
    actor = ActorConfig(strategy="arctic_rl", rollout_n=G, ppo_mini_batch_size=GROUPS, ppo_micro_batch_size_per_gpu=4,
                        use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl")
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    current = client.log_probs(sequences).logprobs
    td["old_log_probs"] = response_nested([torch.tensor(lp) for lp in current])
    td["advantages"] = response_nested([torch.full((len(lp),), float(a)) for lp, a in
                                        zip(current, torch.linspace(-1.0, 1.0, len(current)))])
    # The reference, moved so that the KL term is far from 0 (the policy is still at the initial weights).
    td["ref_log_prob"] = response_nested([r + torch.linspace(-0.3, 0.3, len(r)) for r in ref])
    tu.pop(td, "compute_loss")
    tu.assign_non_tensor(td, global_batch_size=len(current), mini_batch_size=len(current), epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False)
    inputs = td.clone()
    tu.assign_non_tensor(inputs, batch_num_tokens=float(inputs["loss_mask"].sum()), dp_size=1)
    verl_loss, verl_metrics = ppo_loss(actor, model_output={"log_probs": full_row_layout(current, inputs)}, data=inputs)
    bound = rounding_bound(partial(ppo_loss, actor), current, inputs)
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    kl = as_float(next(v for k, v in metrics.items() if k.endswith("kl_loss")))
    assert kl == pytest.approx(as_float(verl_metrics["kl_loss"]), rel=1e-5) and kl > 1e-2
    assert as_float(metrics["arctic/loss"]) == pytest.approx(float(verl_loss), rel=1e-5, abs=bound)


def test_misconfiguration_fails_at_start_up_saying_what_to_fix(tiny_model, server, tmp_path):
    with pytest.raises(ArcticSetupError, match="no Arctic RL server answers at http://127.0.0.1:9 .*actor_rollout_ref.actor.arctic.url"):
        worker_for(tiny_model, "http://127.0.0.1:9")
    other = make_model(str(tmp_path / "other"), hidden=128)
    with pytest.raises(ArcticSetupError, match="actor_rollout_ref.model.path is not the model .*hidden_size: verl 128 vs server 64"):
        worker_for(other, server)
    with pytest.raises(ArcticSetupError, match="actor_rollout_ref.actor.arctic.url is not set"):
        worker_for(tiny_model, None)
    # The same shape with other weights (a base model where the server trains an instruct one, say).
    same_shape = make_model(str(tmp_path / "same-shape"), seed=1)
    with pytest.raises(ArcticSetupError, match="holds other weights than the model .*weights fingerprints differ"):
        worker_for(same_shape, server)


@pytest.mark.parametrize("optim, refused", [
    ({"weight_decay": 0.1}, r"optim.weight_decay=0.1 but the Arctic RL job runs engine.weight_decay=0.01"),
    ({"clip_grad": 5.0}, r"optim.clip_grad=5.0 but the Arctic RL job runs engine.grad_clip=1.0"),
    ({"betas": (0.9, 0.95)}, r"optim.betas=\[0.9, 0.95\] but the Arctic RL job runs engine.betas"),
])
def test_verl_optimizer_settings_the_job_does_not_honour_are_refused_at_start_up(tiny_model, server, optim, refused):
    """A server started with --config runs its own optimizer settings: verl's must agree, or name the difference."""
    with pytest.raises(ArcticSetupError, match=refused):
        worker_for(tiny_model, server, **optim)


def test_the_cpu_process_group_patch_is_recorded_and_refuses_to_patch_twice():
    import verl.utils.distributed as verl_distributed

    from arctic_rl_core.patches import PatchConflict, applied
    from arctic_rl_verl.plugin import cpu_process_group_patch

    rows = {row["patch"]: row for row in applied()}
    row = rows["verl.utils.distributed.initialize_global_process_group_ray"]
    assert row["active"] == 1 and "gloo" in row["reason"] and row["by"] == "arctic_rl_verl.plugin"
    assert rows["verl.workers.rollout.base._ROLLOUT_REGISTRY[('arctic_rl', 'async')]"]["by"] == "arctic_rl_verl.plugin"
    with pytest.raises(PatchConflict, match="already patched"):
        cpu_process_group_patch().apply()
    assert verl_distributed.initialize_global_process_group_ray.__module__ == "arctic_rl_verl.plugin"


def test_without_the_backend_selected_importing_verl_patches_nothing():
    """The adapter installed in verl's environment registers its names, but changes nothing of verl's own
    behaviour until a run selects the arctic-rl backend."""
    code = """
import verl, verl.utils.distributed as d
from arctic_rl_core.patches import applied
print(d.initialize_global_process_group_ray.__module__, [row["patch"] for row in applied()])
"""
    out = run_python(code, timeout=300, ARCTIC_RL_VERL_BACKEND="")
    assert out.returncode == 0, out.stderr[-3000:]
    module, patches = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert module == "verl.utils.distributed", out.stdout
    assert "initialize_global_process_group_ray" not in patches


@pytest.mark.parametrize("first", ["arctic_rl_verl.rollout", "arctic_rl_verl.engine", "verl"])
def test_a_worker_importing_an_adapter_module_first_loads_the_plugin_without_error(first):
    """A Ray worker unpickling the rollout's or engine's class imports that module before verl; the plugin that
    `import verl` runs must still load whole (it once logged a circular-import traceback on every run)."""
    code = f"""
import {first}
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import RolloutReplicaRegistry
print(get_rollout_class("arctic_rl").__name__, RolloutReplicaRegistry.get("arctic_rl").__name__)
"""
    out = run_python(code, timeout=300, ARCTIC_RL_VERL_BACKEND="arctic-rl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed to load" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ArcticRolloutAdapter", "ArcticReplica"]


@pytest.mark.parametrize("setting, refused", [
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_agg_mode='seq-mean-token-sum-norm' needs "
                                                   "actor_rollout_ref.actor.loss_scale_factor"),
    ({"policy_loss": {"loss_mode": "clip_cov"}}, "policy_loss.loss_mode='clip_cov' \\(it picks tokens by a covariance "
                                                 "over verl's micro-batch.*arctic_rl serves vanilla, gspo, cispo, gpg, "
                                                 "sapo, dro, dppo_tv, dppo_kl, bypass_mode, geo_mean"),
    ({"policy_loss": {"loss_mode": "dro"}}, "policy_loss.dro_beta=None: DRO needs a positive value"),
    ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_rs": "token_k1"}}},
     "rollout_correction.rollout_rs='token_k1': arctic_rl serves bypass_mode without rejection sampling"),
    ({"policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": "reinforce", "rollout_is": "sequence"}}},
     "rollout_is='sequence', rollout_is_threshold=2.0: arctic_rl serves token-level weights"),
    ({"use_kl_loss": True, "kl_loss_type": "mse"}, "kl_loss_type='mse' is not supported"),
])
def test_loss_settings_it_cannot_honour_stop_the_run_when_the_actor_config_is_built(setting, refused):
    """verl builds the actor's config when its workers start, before any rollout."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    from arctic_rl_verl.config import ArcticActorConfig

    if "policy_loss" in setting:
        policy = dict(setting["policy_loss"])
        if "rollout_correction" in policy:
            policy["rollout_correction"] = RolloutCorrectionConfig(**policy["rollout_correction"])
        setting = {"policy_loss": PolicyLossConfig(**policy)}
    common = {"rollout_n": G, "ppo_mini_batch_size": GROUPS, "ppo_micro_batch_size_per_gpu": 4}
    ArcticActorConfig(**common)  # verl's defaults are served
    with pytest.raises(ValueError, match=refused):
        ArcticActorConfig(**common, **setting)


def test_verls_warm_up_schedule_reaches_the_servers_steps(tiny_model, server, client):
    """Each optimizer step runs at the learning rate of verl's own schedule (linear warm-up over 3 steps)."""
    worker = worker_for(tiny_model, server, lr_warmup_steps=3, total_training_steps=10)
    engine = worker.engine
    seq = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "advantages": [1.0, 1.0]}]
    seen = []
    for _ in range(5):
        client.fwd_bwd(seq, "sft")
        engine.optimizer_step()
        seen.append(client.status()["backend"]["learning_rate"])
        engine.lr_scheduler_step()
    assert seen == pytest.approx([0.0, 1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2])


def test_start_up_refuses_lengths_past_the_served_context(client):
    from arctic_rl_verl.rollout import check_context

    context = client.status()["backend"]["max_context"]
    check_context(client, context - 16, 16)
    with pytest.raises(ArcticSetupError, match=rf"data.max_prompt_length \+ data.max_response_length = {context} \+ 16 "
                                               rf"exceed the Arctic RL sampler's context of {context} tokens"):
        check_context(client, context, 16)


def test_more_than_one_verl_worker_is_refused_at_start_up(tiny_model, server):
    """Two verl actor workers would each send their shard of a mini-batch and step: refused, saying why."""
    code = ("import sys; sys.path[:0] = ['compat_tests/verl', '.']\n"
            "from test_training_worker import worker_for\n"
            f"try:\n    worker_for({tiny_model!r}, {server!r})\n    print('STARTED')\n"
            "except Exception as err:\n    print('REFUSED', err)\n")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for out in outs:
        assert "REFUSED verl runs 2 actor workers (trainer.n_gpus_per_node x trainer.nnodes)" in out, out


def test_checkpoints_resume_bitwise_without_a_disk_shared_with_the_server(tiny_model, server, client, tmp_path):
    """verl saves into its own folder (not the server's): the server keeps the checkpoint, verl's folder records
    which one and where verl's schedule was; resuming and stepping gives the very state of stepping on."""
    from arctic_rl_core.checkpoint_handles import RECORD_FILE

    worker = worker_for(tiny_model, server, lr_warmup_steps=4, total_training_steps=10)
    seq = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10]}]

    def step(engine):
        client.fwd_bwd(seq, "sft")
        engine.optimizer_step()
        engine.lr_scheduler_step()

    step(worker.engine)
    local = tmp_path / "global_step_1" / "actor"
    worker.save_checkpoint(str(local))
    assert os.listdir(local) == [RECORD_FILE]
    server_path = __import__("json").load(open(local / RECORD_FILE))["server_path"]
    assert os.path.isdir(server_path) and not server_path.startswith(str(tmp_path))
    step(worker.engine)
    continued, continued_lr = client.state_digest(), client.status()["backend"]["learning_rate"]

    step(worker.engine)  # wander off, then resume in a fresh worker (a restarted verl)
    resumed = worker_for(tiny_model, server, lr_warmup_steps=4, total_training_steps=10)
    resumed.load_checkpoint(str(local))
    step(resumed.engine)
    assert client.state_digest() == continued
    assert client.status()["backend"]["learning_rate"] == continued_lr
    with pytest.raises(ArcticSetupError, match=RECORD_FILE):
        resumed.load_checkpoint(str(tmp_path))


def test_a_critic_checkpoint_resumes_bitwise_with_its_schedule(tiny_model, server, client, tmp_path):
    """verl's critic worker saves and resumes the job's critic as the actor's worker does: resuming and stepping
    gives the very state (both models) and the critic's learning rate of stepping on."""
    worker = worker_for(tiny_model, server, "value_model", lr_warmup_steps=4, total_training_steps=10)
    seq = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10], "returns": [0.5, -0.5, 1.0],
            "old_values": [0.0, 0.0, 0.0]}]

    def step(engine):
        client.fwd_bwd(seq, "value", model="critic")
        engine.optimizer_step()
        engine.lr_scheduler_step()

    step(worker.engine)
    local = tmp_path / "global_step_1" / "critic"
    worker.save_checkpoint(str(local))
    step(worker.engine)
    continued = client.state_digest(), client.status()["backend"]["critic"]["learning_rate"]
    values = client.values(seq).values
    step(worker.engine)  # wander off, then resume in a fresh critic worker (a restarted verl)
    resumed = worker_for(tiny_model, server, "value_model", lr_warmup_steps=4, total_training_steps=10)
    resumed.load_checkpoint(str(local))
    step(resumed.engine)
    assert (client.state_digest(), client.status()["backend"]["critic"]["learning_rate"]) == continued
    assert client.values(seq).values == values
    assert 0 < continued[1] < 1e-2  # mid warm-up: the schedule was resumed, not restarted


def test_critic_values_and_value_loss_on_the_jobs_critic(tiny_model, server, client):
    """verl's critic worker (a value-model TrainingWorker) on the job's critic: `compute_values` gives the
    server's values in verl's layout; `update_critic` sends the mini-batch whole, and the value loss the backend
    differentiated equals verl's `value_loss` (its `compute_value_loss`) on the same inputs."""
    from transformers import AutoTokenizer
    from verl.workers.utils.losses import value_loss

    from arctic_rl_verl.config import ArcticCriticConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    worker = worker_for(tiny_model, server, "value_model")
    critic = ArcticCriticConfig(rollout_n=G, ppo_mini_batch_size=GROUPS, ppo_micro_batch_size_per_gpu=4,
                                cliprange_value=0.2, model=HFModelConfig(path=tiny_model))
    worker.set_loss_fn(partial(value_loss, config=critic))
    td = grpo_batch(tokenizer)
    sequences = [Sequence(prompt_ids=p.tolist(), response_ids=r.tolist())
                 for p, r in zip(td["prompts"].unbind(), td["responses"].unbind())]

    # compute_values: verl's worker -> our engine -> the job's critic.
    out = worker.infer_batch(td.clone())["values"]
    served = client.values(sequences).values
    for row, exp, p, r in zip(out.unbind(), served, td["prompts"].unbind(), td["responses"].unbind()):
        assert torch.allclose(row[len(p) - 1 : len(p) - 1 + len(r)], torch.tensor(exp), atol=1e-6)

    # update_critic: old values spread around the current ones (so the clip engages), GAE-like returns.
    old = [torch.tensor(v) + torch.linspace(0.5, -0.5, len(v)) for v in served]
    returns = [torch.linspace(-1.0, 1.0, len(v)) * float(s) for v, s in zip(served, torch.linspace(0.5, 1.5, len(served)))]
    td["values"], td["returns"] = response_nested(old), response_nested(returns)
    tu.pop(td, "compute_loss")
    tu.assign_non_tensor(td, global_batch_size=len(old), mini_batch_size=len(old), epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False)
    reference = td.clone()
    tu.assign_non_tensor(reference, batch_num_tokens=float(reference["loss_mask"].sum()), dp_size=1)
    verl_loss, verl_metrics = value_loss(critic, model_output={"values": full_row_layout(served, reference)},
                                         data=reference)
    digest = client.state_digest()
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    value = lambda key: as_float(next(v for k, v in metrics.items() if k.endswith(key)))  # noqa: E731
    assert value("vf_loss") == pytest.approx(as_float(verl_metrics["critic/vf_loss"]), rel=1e-5, abs=1e-7)
    assert 0 < value("vf_clipfrac") < 1
    assert value("arctic/loss") == pytest.approx(float(verl_loss), rel=1e-5, abs=1e-7)
    assert value("arctic/groups") == GROUPS
    assert client.state_digest() != digest
    after = client.values(sequences).values
    assert max(abs(a - b) for x, y in zip(after, served) for a, b in zip(x, y)) > 1e-4  # the critic trained


def _moe_batch(client, routes_of) -> tuple[TensorDict, list]:
    """Sampled GRPO groups in verl's no-padding layout, each row's `routed_experts` [prompt + response, layers,
    top_k] int16 as verl's agent loop aligns the rollout's (rows past what the sampler recorded zero)."""
    prompts = [[5 + g, 6, 7, 8, 9, 10 + g] for g in range(2)]
    completions = client.generate(prompts, {"n": 3, "max_tokens": 5, "seed": 0, "ignore_eos": True})
    rows = []
    for c in completions:
        prompt, response = torch.tensor(prompts[c.prompt_index]), torch.tensor(c.token_ids)
        record = torch.from_numpy(routes_of(c).astype("int16"))
        aligned = torch.zeros(len(prompt) + len(response), *record.shape[1:], dtype=torch.int16)
        aligned[: len(record)] = record
        rows.append(dict(prompts=prompt, responses=response, input_ids=torch.cat([prompt, response]),
                         position_ids=torch.arange(len(prompt) + len(response)), routed_experts=aligned,
                         response_mask=torch.ones(len(response), dtype=torch.int64), uid=f"uid-{c.prompt_index}"))
    nested = lambda key: torch.nested.as_nested_tensor([r[key] for r in rows], layout=torch.jagged)  # noqa: E731
    keys = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "routed_experts")
    td = TensorDict({k: nested(k) for k in keys}, batch_size=[len(rows)])
    td["loss_mask"] = nested("response_mask")
    td["uid"] = NonTensorStack(*[r["uid"] for r in rows])
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, compute_loss=False)
    return td, completions


def _update(worker, td, logprobs):
    actor = ActorConfig(strategy="arctic_rl", rollout_n=3, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                        use_kl_loss=False, loss_agg_mode="token-mean")
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    td["old_log_probs"] = response_nested([torch.tensor(lp) for lp in logprobs])
    td["advantages"] = response_nested([torch.full((len(lp),), float(a)) for lp, a in zip(logprobs, [1, -1, 0.5] * 2)])
    tu.pop(td, "compute_loss")
    tu.assign_non_tensor(td, global_batch_size=len(logprobs), mini_batch_size=len(logprobs), epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, calculate_entropy=False)
    return tu.get(worker.train_mini_batch(td), "metrics")


def test_router_replay_r3_replays_the_batchs_routes_in_verls_log_probs_and_update(moe_server):
    """`router_replay.mode=R3`: the routes verl's rollout put in the batch are what the trainer routes by, in
    compute_log_prob and in the update (checked with routes other than the sampler's, which move the log-probs)."""
    import numpy as np

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.types import RoutedExperts

    model, url = moe_server
    client = ArcticRLClient(url, retries=0)
    rng = np.random.default_rng(0)

    def other(c):  # random routes for the sampler's recorded tokens (distinct experts per token and layer)
        shape = c.routed_experts.array().shape
        return np.argsort(rng.random((*shape[:2], 4)), axis=-1)[..., : shape[2]]

    td, completions = _moe_batch(client, other)
    worker = worker_for(model, url, router_replay="R3")
    out = worker.infer_batch(td.clone())
    records = [RoutedExperts.of(r[: len(p) + len(c.token_ids) - 1].numpy())
               for r, p, c in zip(td["routed_experts"].unbind(), td["prompts"].unbind(), completions)]
    sequences = [Sequence(prompt_ids=p.tolist(), response_ids=c.token_ids, routed_experts=r)
                 for p, c, r in zip(td["prompts"].unbind(), completions, records)]
    replayed = client.log_probs(sequences)
    native = client.log_probs([s.model_copy(update={"routed_experts": None}) for s in sequences])
    moved = 0.0
    for row, exp, own, p, c in zip(out["log_probs"].unbind(), replayed.logprobs, native.logprobs, td["prompts"].unbind(),
                                   completions):
        got = row[len(p) - 1 : len(p) - 1 + len(c.token_ids)]
        assert torch.allclose(got, torch.tensor(exp), atol=1e-6)
        moved = max(moved, float((got - torch.tensor(own)).abs().max()))
    assert moved > 1e-3  # the batch's routes, not the trainer's own, were used
    metrics = _update(worker, td, replayed.logprobs)
    # The update's forward replayed the same routes: its log-probs are the old ones (without, they move by `moved`).
    assert abs(as_float(metrics["actor/ppo_kl"])) < 1e-6 and as_float(metrics["actor/pg_clipfrac"]) == 0


def test_router_replay_r2_records_in_compute_log_prob_and_replays_in_the_update(moe_server):
    """`router_replay.mode=R2`: verl's compute_log_prob returns the routing the trainer took (`routed_experts`,
    the key verl carries into the update's batch), and the update replays it."""
    from arctic_rl_core.client import ArcticRLClient

    model, url = moe_server
    client = ArcticRLClient(url, retries=0)
    td, completions = _moe_batch(client, lambda c: c.routed_experts.array())
    del td["routed_experts"]  # R2: the rollout records nothing
    worker = worker_for(model, url, router_replay="R2")
    out = worker.infer_batch(td.clone())
    sequences = [Sequence(prompt_ids=p.tolist(), response_ids=c.token_ids)
                 for p, c in zip(td["prompts"].unbind(), completions)]
    own = client.log_probs(sequences)
    for row, taken, p, c in zip(out["routed_experts"].unbind(), own.routed_experts, td["prompts"].unbind(), completions):
        assert row.shape[0] == len(p) + len(c.token_ids) and torch.equal(row.long(), torch.from_numpy(taken.array()))
    td["routed_experts"] = out["routed_experts"]
    metrics = _update(worker, td, own.logprobs)
    assert abs(as_float(metrics["actor/ppo_kl"])) < 1e-6 and as_float(metrics["arctic/groups"]) == 2


def test_router_replay_on_a_job_that_does_not_replay_is_refused_at_start_up(tiny_model, server):
    with pytest.raises(ArcticSetupError, match="router_replay.mode=R3: the Arctic RL job replays no routing"):
        worker_for(tiny_model, server, router_replay="R3")
