"""The critic role: values, the clipped value loss, its own optimizer, checkpoints, and bad requests."""

from __future__ import annotations

import random

import pytest
import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Sequence
from helpers import grpo_batch

CRITIC = {"enable": True, "engine": {"learning_rate": 5e-3, "zero_stage": 0}}


def with_targets(seqs: list[Sequence], old: list[list[float]], seed: int = 0) -> list[Sequence]:
    """GAE's fields on a batch: returns to regress to, and the values it was scored with."""
    rng = random.Random(seed)
    return [s.model_copy(update={"returns": [rng.uniform(-1, 1) for _ in s.response_ids], "old_values": o})
            for s, o in zip(seqs, old)]


def reference_value_loss(values, seqs: list[Sequence], clip: float) -> float:
    """verl's compute_value_loss, token-mean over the batch, written out."""
    terms = []
    for v, s in zip(values, seqs):
        v, r, o = torch.tensor(v, dtype=torch.float64), torch.tensor(s.returns, dtype=torch.float64), torch.tensor(s.old_values, dtype=torch.float64)
        clipped = o + (v - o).clamp(-clip, clip)
        terms.append(torch.maximum((v - r) ** 2, (clipped - r) ** 2))
    return float(0.5 * torch.cat(terms).mean())


@pytest.fixture(scope="module")
def trained_critic(tiny_model):
    """A backend whose critic took a few steps (its value head starts at zero: every value 0)."""
    from arctic_rl_core.backend import InProcessBackend

    backend = InProcessBackend({"model_path": tiny_model, "engine": {"learning_rate": 1e-3, "zero_stage": 0},
                                "sampler": {"name": "transformers"}, "critic": CRITIC})
    seqs = grpo_batch(groups=2, group_size=3)
    assert all(v == 0.0 for row in backend.values(seqs).values for v in row)
    for step in range(3):
        batch = with_targets(seqs, backend.values(seqs).values, seed=step)
        backend.fwd_bwd(batch, {"name": "value", "config": {"cliprange_value": 0.2}}, model="critic")
        backend.step(model="critic")
    return backend, seqs


def test_values_packed_and_padded_agree(trained_critic):
    backend, seqs = trained_critic
    packed = backend.values(seqs).values
    backend.config.zorro.enable = False
    try:
        padded = backend.values(seqs).values
    finally:
        backend.config.zorro.enable = True
    assert any(abs(v) > 1e-3 for row in packed for v in row)  # the head trained: not the zero start
    for a, b in zip(packed, padded):
        assert len(a) == len(b)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_the_value_loss_is_verls_and_the_critic_learns_the_returns(trained_critic):
    backend, seqs = trained_critic
    policy_digest = backend.engine.state_digest()
    batch = with_targets(seqs, backend.values(seqs).values, seed=7)
    losses = []
    for _ in range(12):
        values = backend.values(batch).values
        result = backend.fwd_bwd(batch, {"name": "value", "config": {"cliprange_value": 10.0}}, model="critic")
        assert result.loss == pytest.approx(reference_value_loss(values, batch, 10.0), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(torch.tensor(sum(result.values, [])), torch.tensor(sum(values, [])), rtol=1e-6,
                                   atol=1e-7)  # the values of its own forward
        losses.append(result.loss)
        step = backend.step(model="critic")
    assert losses[-1] < losses[0] / 2, losses
    assert step.step == 3 + 12  # the critic's own step count
    assert backend.engine.state_digest() == policy_digest and backend.engine.steps == 0  # the policy never moved
    assert backend.describe()["critic"]["optimizer_steps"] == 15


def test_a_tight_clip_holds_the_values_near_the_old_ones(trained_critic):
    backend, seqs = trained_critic
    old = backend.values(seqs).values
    batch = with_targets(seqs, [[v + 1.0 for v in row] for row in old], seed=3)  # old values 1 above the current
    values = backend.values(batch).values
    result = backend.fwd_bwd(batch, {"name": "value", "config": {"cliprange_value": 0.1}}, model="critic")
    backend.discard_gradients(model="critic")
    assert result.loss == pytest.approx(reference_value_loss(values, batch, 0.1), rel=1e-5, abs=1e-7)
    assert result.metrics["vf_clipfrac"] > 0


def test_roles_and_fields_are_checked_by_name(trained_critic, make_backend):
    backend, seqs = trained_critic
    digest = backend.state_digest()
    with pytest.raises(InvalidRequest) as err:
        backend.fwd_bwd(seqs, "value", model="critic")  # no returns / old values
    assert err.value.field.startswith("sequences[0]")
    with pytest.raises(InvalidRequest, match="trains the critic, not the policy"):
        backend.fwd_bwd(with_targets(seqs, [[0.0] * len(s.response_ids) for s in seqs]), "value")
    with pytest.raises(InvalidRequest, match="trains the policy, not the critic"):
        backend.fwd_bwd(seqs, "grpo", model="critic")
    with pytest.raises(InvalidRequest, match="no critic gradients"):
        backend.step(model="critic")
    with pytest.raises(InvalidRequest) as err:
        backend.fwd_bwd(seqs, "grpo", model="value-head")
    assert err.value.field == "model"
    assert backend.state_digest() == digest
    plain = make_backend()
    with pytest.raises(InvalidRequest, match="critic.enable"):
        plain.values(seqs)


def test_checkpoints_hold_the_critic(make_api, tmp_path):
    api = make_api(critic=CRITIC, zero_stage=0)
    seqs = grpo_batch(groups=1, group_size=3)

    def train_critic(seed):
        api.fwd_bwd(with_targets(seqs, api.values(seqs).values, seed), "value", model="critic")
        api.step(model="critic")

    from arctic_rl_core.client import ArcticRLClient

    path = "ckpt" if isinstance(api, ArcticRLClient) else str(tmp_path / "ckpt")  # the server confines its paths
    train_critic(0)
    api.save_checkpoint(path)
    digest, values = api.state_digest(), api.values(seqs).values
    train_critic(1)
    assert api.values(seqs).values != values
    api.load_checkpoint(path)
    assert api.state_digest() == digest and api.values(seqs).values == values


def test_a_framework_critic_is_checked_against_the_jobs(tiny_model, tmp_path):
    """What an adapter's critic checks at start-up: the job has a critic, on the same weights, and the critic's
    optimizer settings are the job's `engine` under `critic.engine`."""
    from arctic_rl_core.attach import ArcticSetupError, check_critic
    from arctic_rl_core.models.fingerprint import checkpoint_fingerprint

    config = {"engine": {"weight_decay": 0.01, "grad_clip": 1.0}, "critic": {"engine": {"weight_decay": 0.1}}}
    with pytest.raises(ArcticSetupError, match=r"critic.model.path\): start the server's job with critic.enable: true"):
        check_critic(tiny_model, {"backend": {"critic": None}, "config": config}, "critic.model.path")
    served = {"model_path": "/elsewhere", "weights_fingerprint": "0" * 64}
    with pytest.raises(ArcticSetupError, match="critic.model.path .* holds other weights than the Arctic RL job's critic"):
        check_critic(tiny_model, {"backend": {"critic": served}, "config": config}, "critic.model.path")
    served["weights_fingerprint"] = checkpoint_fingerprint(tiny_model)
    engine = check_critic(tiny_model, {"backend": {"critic": served}, "config": config}, "critic.model.path")
    assert engine == {"config": {"engine": {"weight_decay": 0.1, "grad_clip": 1.0}}}
