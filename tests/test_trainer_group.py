"""`engine.ranks: 2`: two DeepSpeed ranks as Ray actors (gloo) give the loss, log-probs and update of one
rank on the whole batch, for ZeRO 1, 2 and 3, ZoRRo on and off; GRPO groups never span ranks."""

from __future__ import annotations

import os
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.engines.trainer_group import TrainerRankFailed
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Sequence

# One Ray cluster at a time: `make scenarios` keeps the files that start one on the same worker.
pytestmark = [pytest.mark.scenario, pytest.mark.xdist_group("ray")]

RTOL = 1e-5


def unequal_groups(seed: int = 0) -> list[Sequence]:
    """Groups of 5, 1, 3 and 2 sequences plus one ungrouped sequence, responses of different lengths."""
    rng = random.Random(seed)
    seqs = []
    for g, size in enumerate([5, 1, 3, 2]):
        prompt = [rng.randrange(3, 400) for _ in range(rng.randrange(8, 20))]
        for _ in range(size):
            n = rng.randrange(3, 12)
            seqs.append(Sequence(prompt_ids=prompt, response_ids=[rng.randrange(3, 400) for _ in range(n)], group_id=g,
                                 advantages=[rng.uniform(-1, 1)] * n, behaviour_logprobs=[-rng.uniform(3, 9) for _ in range(n)]))
    seqs.append(Sequence(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], advantages=[0.5] * 4,
                         behaviour_logprobs=[-4.0] * 4))
    rng.shuffle(seqs)
    return seqs


def config(model: str, stage: int, ranks: int) -> dict:
    # A small token budget: several micro-batches per call, and the largest group split between two.
    return {"model_path": model, "sampler": {"name": "transformers"},
            "engine": {"zero_stage": stage, "ranks": ranks, "learning_rate": 1e-3, "micro_batch_tokens": 96}}


def weights(api: InProcessBackend) -> dict[str, torch.Tensor]:
    return {name: tensor.float().clone() for name, tensor in api.engine.named_full_weights()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= RTOL * b.abs() + 1e-7).all())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_update_exactly_as_one_rank_on_the_whole_batch(tiny_model, stage):
    seqs = unequal_groups()
    one = InProcessBackend(config(tiny_model, stage, 1))
    two = InProcessBackend(config(tiny_model, stage, 2))
    try:
        assert len(two.engine.placement) == 2
        for zorro in (True, False):  # the one switch, flipped at run time
            one.config.zorro.enable = two.config.zorro.enable = zorro
            a, b = one.fwd_bwd(seqs, "grpo"), two.fwd_bwd(seqs, "grpo", return_logprobs=True)
            assert b.loss == pytest.approx(a.loss, rel=RTOL, abs=1e-7)
            assert b.computed_tokens == a.computed_tokens and b.num_tokens == a.num_tokens
            for name, value in a.metrics.items():
                assert b.metrics[name] == pytest.approx(value, rel=RTOL, abs=1e-6), name
            plan = two.engine.last_plan
            assert all(plan.micro_batches) and plan.groups[0].isdisjoint(plan.groups[1]), plan
            lp_a, lp_b = one.log_probs(seqs).logprobs, two.log_probs(seqs).logprobs
            for x, y, z in zip(lp_a, lp_b, b.logprobs):  # fwd_bwd's own log-probs: gathered from both ranks
                assert close(torch.tensor(y), torch.tensor(x)) and close(torch.tensor(z), torch.tensor(x))
            step_a, step_b = one.step(), two.step()
            assert step_b.grad_norm == pytest.approx(step_a.grad_norm, rel=RTOL)
            wa, wb = weights(one), weights(two)
            assert wa.keys() == wb.keys()
            bad = [name for name in wa if not close(wb[name], wa[name])]
            assert not bad, f"ZeRO-{stage} zorro={zorro}: weights differ in {bad[:5]}"
        assert two.engine.steps == 2
        assert len({row["pid"] for row in two.describe()["trainer"]}) == 2

        # A refusal on one rank only (one group's loss is infinite): the ranks stay in step, the call fails
        # naming the loss, and the gradients pending from before it are kept exactly.
        poisoned = [s.model_copy(update={"behaviour_logprobs": [-1e30] * len(s.response_ids)}) if s.group_id == 0 else s
                    for s in seqs]
        pool = ThreadPoolExecutor(1)  # a hang (ranks out of step) fails the test instead of blocking it
        try:
            for api in (one, two):
                api.fwd_bwd(seqs, "grpo")
                with pytest.raises(InvalidRequest) as err:
                    pool.submit(api.fwd_bwd, poisoned, {"name": "importance_sampling"}).result(timeout=300)
                assert err.value.field == "loss"
        finally:
            pool.shutdown(wait=False)
        step_a, step_b = one.step(), two.step()
        assert step_b.grad_norm == pytest.approx(step_a.grad_norm, rel=RTOL)
        wa, wb = weights(one), weights(two)
        assert all(close(wb[name], wa[name]) for name in wa)
    finally:
        two.close()


def test_more_ranks_than_the_cluster_can_place_fail_at_start_naming_the_setting(tiny_model):
    import ray

    cfg = config(tiny_model, 2, 64)
    cfg["ray"] = {"num_cpus": 2}
    with pytest.raises(InvalidRequest) as err:
        InProcessBackend(cfg)
    assert err.value.field == "engine.ranks" and "64 CPU needed, the cluster has 2" in str(err.value)
    assert not ray.is_initialized()  # the job's local Ray was stopped: no actors or placement groups left


# A stopped rank 1 leaves rank 0 waiting in a collective too: both may be named.
FAULTS = {"killed": "died", "stopped": r"ranks \[(0, )?1\] did not answer within ray.call_timeout_s=20 s"}


@pytest.fixture(scope="module")
def faulted(tiny_model, tmp_path_factory):
    """Each fault on a 2-rank job that had stepped and saved a checkpoint, one job after the other: what the calls
    after it raised, and the job's status. Then one new 2-rank job loads each checkpoint in turn (a new job per
    checkpoint would start the same two ranks again): the state it then holds."""
    import ray

    found = {}
    for fault in FAULTS:
        seqs, path = unequal_groups(), str(tmp_path_factory.mktemp(fault) / "ckpt")
        api = InProcessBackend({**config(tiny_model, 2, 2), "ray": {"call_timeout_s": 20}})
        try:
            api.fwd_bwd(seqs, "grpo")
            api.step()
            api.save_checkpoint(path)
            row = found[fault] = {"path": path, "saved": api.state_digest()}
            if fault == "killed":
                ray.kill(api.engine.actors[1], no_restart=True)
            else:  # alive but answering nothing, as a rank hung in a collective
                os.kill(api.describe()["trainer"][1]["pid"], signal.SIGSTOP)
            calls = ThreadPoolExecutor(1)  # rank 0 is left in a collective: the call must not wait for it
            for call, name in ((lambda: calls.submit(api.fwd_bwd, seqs, "grpo").result(timeout=120), "fwd_bwd"),
                               (api.step, "step")):  # the group refuses every later call at once
                try:
                    call()
                except Exception as raised:
                    row[name] = raised
            calls.shutdown(wait=False)
            row["status"] = api.describe()
        finally:
            api.close()
    fresh = InProcessBackend(config(tiny_model, 2, 2))
    try:
        for row in found.values():
            info = fresh.load_checkpoint(row["path"])
            row["resumed"] = info.step, fresh.state_digest()
    finally:
        fresh.close()
    return found


@pytest.mark.parametrize("fault", FAULTS)
def test_a_rank_that_died_or_hung_fails_the_call_saying_so_and_the_job_resumes_from_its_checkpoint(faulted, fault):
    row = faulted[fault]
    assert isinstance(row.get("fwd_bwd"), TrainerRankFailed), row.get("fwd_bwd")
    assert re.search(f"{FAULTS[fault]}.*load_checkpoint", str(row["fwd_bwd"])), str(row["fwd_bwd"])
    assert isinstance(row.get("step"), TrainerRankFailed), row.get("step")
    status = row["status"]
    assert status["optimizer_steps"] is None and "load_checkpoint" in status["trainer_error"]
    assert [r["healthy"] for r in status["trainer"]] == [False, False]
    assert row["resumed"] == (1, row["saved"])
