"""Tinker's API on `arctic-rl serve`, driven by the unmodified `tinker` SDK; Tinker's losses against their
documented definitions (tinker-cookbook's docs/losses.mdx, written out below as the reference)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tinker  # noqa: E402  (the `tinker` extra, which make install installs: the Tinker routes need it)
from tinker import types  # noqa: E402

from arctic_rl_core.batching import batch_loss_inputs  # noqa: E402
from arctic_rl_core.client import ArcticRLClient  # noqa: E402
from arctic_rl_core.config import BackendConfig  # noqa: E402
from arctic_rl_core.engines.distributed import free_loopback_port  # noqa: E402
from arctic_rl_core.errors import InvalidRequest  # noqa: E402
from arctic_rl_core.plugins.manager import load_plugins  # noqa: E402
from arctic_rl_core.server.app import ServerSettings  # noqa: E402
from arctic_rl_core.server.run import ServerThread  # noqa: E402
from arctic_rl_core.tinker.futures import SeqOrder  # noqa: E402
from arctic_rl_core.tinker.losses import loss_spec, with_loss_inputs  # noqa: E402
from arctic_rl_core.types import Sequence  # noqa: E402

from conftest import LIGHT_SAMPLER  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"
MODEL = "tiny/qwen3"
ADAM = dict(beta1=0.9, beta2=0.95, eps=1e-8)
# The optimizer the job was built with: what Tinker's AdamParams above ask for (no gradient clipping).
ENGINE = {"learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": None}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    config = BackendConfig.model_validate({"model_path": tiny_model, "engine": ENGINE, "sampler": LIGHT_SAMPLER})
    settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL, tinker_full_parameter=True,
                              checkpoint_dir=str(tmp_path_factory.mktemp("checkpoints")))
    with ServerThread(settings, config) as url:
        yield url


@pytest.fixture
def arctic(server):
    return ArcticRLClient(server, retries=0)


def service(url: str, key: str = "tml-local") -> "tinker.ServiceClient":
    return tinker.ServiceClient(base_url=url, api_key=key)


def datum(tokens: list[int], **inputs) -> types.Datum:
    """Tokens as a next-token datum: inputs x[:-1], targets x[1:], per-position `inputs`."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def sft_data() -> list[types.Datum]:
    rows = [[11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 40, 41, 42], [11, 12, 13, 14, 15, 60, 61, 62, 63]]
    # Prompt positions weigh 0 (the first three targets), completion positions 1.
    return [datum(r, weights=[0.0] * 2 + [1.0] * (len(r) - 3)) for r in rows]


def trained_one_step(sc: "tinker.ServiceClient", data: list[types.Datum], **create) -> "tinker.TrainingClient":
    """A new model (`create`: more of its settings), one supervised step on `data` in."""
    tc = sc.create_lora_training_client(base_model=MODEL, rank=32, **create).result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()
    return tc


def model_digest(url: str, tc: "tinker.TrainingClient", key: str = "tml-local") -> str:
    """The digest of a Tinker model's weights and optimizer state (the server's `arctic/state_digest`)."""
    import httpx

    response = httpx.post(f"{url}/api/v1/arctic/state_digest", json={"model_id": tc.model_id},
                          headers={"X-API-Key": key}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["digest"]


def as_sequence(d: types.Datum) -> Sequence:
    tokens = d.model_input.to_ints()
    return Sequence(prompt_ids=tokens[:1], response_ids=tokens[1:] + [int(d.loss_fn_inputs["target_tokens"].data[-1])])


def test_supervised_loop_trains_and_returns_the_models_own_log_probs(server, arctic):
    data = sft_data()
    with service(server) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        info = tc.get_info()
        assert info.model_data.model_name == MODEL and info.is_lora is False
        expected = arctic.log_probs([as_sequence(d) for d in data]).logprobs
        losses = []
        for step in range(4):
            out = tc.forward_backward(data, "cross_entropy").result()
            if step == 0:  # the positions' log-probs under the weights the gradient was taken at
                for row, exp in zip(out.loss_fn_outputs, expected):
                    assert np.allclose(row["logprobs"].to_numpy(), exp, atol=1e-5)
            losses.append(out.metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()
        assert losses[-1] < 0.8 * losses[0], losses


def test_the_quickstarts_flow_trains_with_the_sdks_default_adam_params(server):
    """The flow of Tinker's supervised quickstart, as a user copies it with only the base URL changed: the SDK's
    tokenizer, prompt tokens weighted 0 and completion tokens 1, forward_backward and optim_step submitted before
    either is awaited, `AdamParams(learning_rate=1e-4)` with the SDK's defaults for the rest, the loss per token
    read from the returned log-probs; then a sampling client of the trained weights."""
    pairs = [("Reverse: abc\nAnswer:", " cba"), ("Reverse: hello\nAnswer:", " olleh"),
             ("Reverse: tinker\nAnswer:", " reknit"), ("Reverse: model\nAnswer:", " ledom")]
    with service(server) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32)
        tokenizer = tc.get_tokenizer()

        def example(prompt: str, completion: str) -> types.Datum:
            prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
            completion_tokens = tokenizer.encode(completion + "\n", add_special_tokens=False)
            tokens = prompt_tokens + completion_tokens
            weights = [0.0] * len(prompt_tokens) + [1.0] * len(completion_tokens)
            return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})

        data = [example(*pair) for pair in pairs]
        losses = []
        for _ in range(6):
            fwdbwd = tc.forward_backward(data, "cross_entropy")
            optim = tc.optim_step(types.AdamParams(learning_rate=1e-4))
            result, _ = fwdbwd.result(), optim.result()
            logprobs = np.concatenate([out["logprobs"].tolist() for out in result.loss_fn_outputs])
            weights = np.concatenate([d.loss_fn_inputs["weights"].tolist() for d in data])
            losses.append(-np.dot(logprobs, weights) / weights.sum())
        assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
        sampler = tc.save_weights_and_get_sampling_client(name="reverse").result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("Reverse: abc\nAnswer:"))
        result = sampler.sample(prompt=prompt, num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"])).result()
        assert len(result.sequences) == 2 and result.sequences[0].tokens == result.sequences[1].tokens
        assert isinstance(tokenizer.decode(result.sequences[0].tokens), str)


def test_forward_reports_the_loss_forward_backward_differentiates(server, arctic):
    data = sft_data()
    rl = [datum(d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].data[-1])],
                logprobs=[-3.0 + 0.1 * k for k in range(d.model_input.length)],
                advantages=[0.0, 0.0] + [(-1.0) ** k for k in range(d.model_input.length - 2)]) for d in data]
    masked = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sequence_ratio_mask": [0.0, 0.0] + [1.0] * (d.model_input.length - 2)}) for d in rl]
    cases = [("cross_entropy", data, None), ("importance_sampling", rl, None),
             ("ppo", rl, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", rl, None),
             ("dro", rl, {"beta": 0.05}), ("gspo", masked, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})]
    with service(server) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        digest = model_digest(server, tc)
        for name, batch, config in cases:
            forward = tc.forward(batch, name, config).result().metrics["loss:sum"]
            backward = tc.forward_backward(batch, name, config).result().metrics["loss:sum"]
            assert forward == pytest.approx(backward, rel=1e-5, abs=1e-6), name
        # Gradients accumulate; the weights and optimizer are as they were until a step.
        assert model_digest(server, tc) == digest
        tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()
        assert model_digest(server, tc) != digest


def documented(name: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """Tinker's losses as tinker-cookbook's docs/losses.mdx writes them (summed over positions)."""
    if name == "cross_entropy":
        return (-logp * inputs["weights"]).sum()
    ratio = torch.exp(logp - inputs["logprobs"])
    advantages = inputs["advantages"]
    if name == "importance_sampling":
        return -(ratio * advantages).sum()
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    clipped = torch.clamp(ratio, low, high)
    if name == "ppo":
        return -torch.min(ratio * advantages, clipped * advantages).sum()
    if name == "cispo":
        return -(clipped.detach() * logp * advantages).sum()
    if name == "dro":
        return -(logp * advantages - 0.5 * config["beta"] * (logp - inputs["logprobs"]) ** 2).sum()
    raise AssertionError(name)


@pytest.mark.parametrize("name, config", [
    ("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.4}), ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.3}), ("dro", {"beta": 0.05})])
def test_each_tinker_loss_is_its_documented_definition(name, config):
    """Value and gradient of the registry loss a Tinker loss maps to, against the documented formula, on ratios
    that fall below, inside and above the clip range and on advantages (weights) of both signs."""
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 12]
    logp = -torch.rand(sum(lengths), generator=gen, dtype=torch.float64).float() * 4
    # The sampler's log-probs: the ratio exp(logp - q) spreads over [0.55, 1.8].
    inputs = {"logprobs": (logp + torch.empty_like(logp).uniform_(-0.6, 0.6, generator=gen)).clamp(max=0),
              "advantages": torch.randn(logp.shape, generator=gen),
              "weights": torch.randn(logp.shape, generator=gen)}
    keys = ["weights"] if name == "cross_entropy" else ["logprobs", "advantages"]
    sequences, arrays, start = [], [], 0
    for n in lengths:
        sequences.append(Sequence(prompt_ids=[1], response_ids=list(range(2, 2 + n))))
        arrays.append({key: inputs[key][start : start + n].numpy() for key in keys})
        start += n
    spec = loss_spec(name, {k: float(v) for k, v in config.items()})
    entry = load_plugins().losses.get(spec.name, "loss")
    ours_logp = logp.clone().requires_grad_()
    ours, _ = entry.fn({"logprobs": ours_logp}, batch_loss_inputs(with_loss_inputs(name, sequences, arrays), 0),
                       entry.parse_config(spec.config, "config"))
    ours.backward()
    theirs_logp = logp.clone().requires_grad_()
    theirs = documented(name, theirs_logp, inputs, config)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours_logp.grad, theirs_logp.grad, rtol=1e-5, atol=1e-6)
    if name in ("ppo", "cispo"):  # the clip was exercised on both sides
        ratio = torch.exp(logp - inputs["logprobs"])
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        assert (ratio < low).any() or low == 0.0
        assert (ratio > high).any() and ((ratio > low) & (ratio < high)).any()


def documented_gspo(logp: torch.Tensor, q: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    lengths: list[int], low: float, high: float) -> torch.Tensor:
    """Tinker's GSPO as its docs write it, one datum at a time: every token carries its sequence's ratio (the
    geometric mean over the masked positions) with its own log-prob's gradient, clipped as PPO's."""
    total, start = 0.0, 0
    for n in lengths:
        lp, ref, adv = logp[start:start + n], q[start:start + n], advantages[start:start + n]
        in_ratio = mask[start:start + n] != 0
        log_ratio = (lp.detach() - ref)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        total = total - torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
        start += n
    return total


def test_gspo_is_its_documented_definition():
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 5, 12, 7, 6, 10]
    # Each datum's sampler log-probs shifted by its own offset: sequence ratios below, inside and above the bounds.
    offsets = torch.cat([torch.full((n,), off) for n, off in zip(lengths, (0.3, -0.25, 0.01, 0.15, -0.02, -0.4))])
    logp = -torch.rand(sum(lengths), generator=gen, dtype=torch.float64).float() * 4
    q = logp + offsets + torch.empty_like(logp).uniform_(-0.05, 0.05, generator=gen)
    # The first two positions of each datum (its prompt) are outside the ratio's mask and have no advantage.
    mask = torch.cat([torch.tensor([0.0, 0.0] + [1.0] * (n - 2)) for n in lengths])
    advantages = torch.randn(logp.shape, generator=gen) * mask
    low, high = 0.9, 1.1
    sequences, arrays, start = [], [], 0
    for n in lengths:
        sequences.append(Sequence(prompt_ids=[1], response_ids=list(range(2, 2 + n))))
        arrays.append({"logprobs": q[start:start + n].numpy(), "advantages": advantages[start:start + n].numpy(),
                       "sequence_ratio_mask": mask[start:start + n].numpy()})
        start += n
    spec = loss_spec("gspo", {"clip_low_threshold": low, "clip_high_threshold": high})
    entry = load_plugins().losses.get(spec.name, "loss")
    ours_logp = logp.clone().requires_grad_()
    ours, _ = entry.fn({"logprobs": ours_logp}, batch_loss_inputs(with_loss_inputs("gspo", sequences, arrays), 0),
                       entry.parse_config(spec.config, "config"))
    ours.backward()
    theirs_logp = logp.clone().requires_grad_()
    theirs = documented_gspo(theirs_logp, q, advantages, mask, lengths, low, high)
    theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-6)
    assert torch.allclose(ours_logp.grad, theirs_logp.grad, rtol=1e-5, atol=1e-6)
    # The sequence ratios fell below, inside and above the clip range.
    ratios = [float(torch.exp(-torch.tensor(off))) for off in (0.3, -0.25, 0.01, 0.15, -0.02, -0.4)]
    assert min(ratios) < low and max(ratios) > high and any(low < r < high for r in ratios)
    # What the server cannot compute as Tinker does is refused by name.
    with pytest.raises(InvalidRequest, match="loss_fn_config.clip_high_threshold"):
        loss_spec("gspo", {"clip_low_threshold": low})
    outside = [{**arrays[0], "advantages": np.ones_like(arrays[0]["advantages"])}]
    with pytest.raises(InvalidRequest, match=r"data\[0\].loss_fn_inputs.advantages"):
        with_loss_inputs("gspo", sequences[:1], outside)
    with pytest.raises(InvalidRequest, match=r"data\[0\].loss_fn_inputs.sequence_ratio_mask"):
        with_loss_inputs("gspo", sequences[:1], [{**arrays[0], "sequence_ratio_mask": np.zeros(9, np.float32),
                                                  "advantages": np.zeros(9, np.float32)}])


def test_sampling_follows_the_saved_weights_and_keeps_older_snapshots_and_the_base(server, arctic):
    """A full-parameter job's sampler holds one set of weights: each save is a snapshot on disk, loaded when
    sampled, so the base model and older snapshots sample their own weights after newer saves (as on Tinker)."""
    prompt = [11, 12, 13, 14]
    greedy_params = types.SamplingParams(max_tokens=5, temperature=0.0)

    def greedy_of(client) -> tuple[list[int], list[float]]:
        sequence = client.sample(types.ModelInput.from_ints(prompt), 1, greedy_params).result().sequences[0]
        return list(sequence.tokens), list(sequence.logprobs)

    with service(server) as sc:
        base_before = greedy_of(sc.create_sampling_client(base_model=MODEL))
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4,
                                sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0)).result()
        assert len(result.sequences) == 4
        # An RL step on them: the sampler's log-probs are the trainer's for the same weights.
        data = [datum(prompt + list(s.tokens), logprobs=[0.0] * (len(prompt) - 1) + list(s.logprobs),
                      advantages=[0.0] * (len(prompt) - 1) + [a] * len(s.tokens))
                for s, a in zip(result.sequences, (1.0, -1.0, 0.5, -0.5))]
        out = tc.forward_backward(data, "importance_sampling").result()
        for row, s in zip(out.loss_fn_outputs, result.sequences):
            assert np.allclose(row["logprobs"].to_numpy()[len(prompt) - 1 :], s.logprobs, atol=1e-4)
        prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(result.sequences[0].tokens))).result()
        assert prompt_logprobs[0] is None
        assert np.allclose(prompt_logprobs[len(prompt):], result.sequences[0].logprobs, atol=1e-4)
        # The k most likely tokens at each position, most likely first: a greedy sample's tokens head their rows, and
        # so do they as a prompt.
        greedy = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, topk_sample_logprobs=3,
                                sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
        scored = sampler.sample(types.ModelInput.from_ints(prompt + list(greedy.tokens)), num_samples=1,
                                include_prompt_logprobs=True, topk_prompt_logprobs=2,
                                sampling_params=types.SamplingParams(max_tokens=1)).result()
        assert scored.topk_prompt_logprobs[0] is None and len(scored.topk_prompt_logprobs) == len(prompt) + 5
        for rows in (greedy.topk_logprobs, scored.topk_prompt_logprobs[len(prompt):]):
            for row, token, logprob in zip(rows, greedy.tokens, greedy.logprobs):
                assert row[0][0] == token and abs(row[0][1] - logprob) < 1e-4 and row[1][1] <= row[0][1]
        first = (list(greedy.tokens), list(greedy.logprobs))
        newer = []
        for _ in range(2):  # two steps, each saved for the sampler
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2, **ADAM)).result()
            newer.append(tc.save_weights_and_get_sampling_client().result())
        scored_row = datum(prompt + first[0], weights=[1.0] * (len(prompt) + len(first[0]) - 1))
        trained = tc.forward([scored_row], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        # Samples of three snapshots interleaved: each its own weights, the sampler loading each in turn.
        for _ in range(2):
            old_tokens, old_logprobs = greedy_of(sampler)
            assert old_tokens == first[0] and np.allclose(old_logprobs, first[1], atol=1e-5)
            newest = newer[-1].compute_logprobs(types.ModelInput.from_ints(prompt + first[0])).result()
            assert np.allclose(newest[len(prompt):], trained.to_numpy()[len(prompt) - 1:], atol=1e-4)
            assert not np.allclose(newest[len(prompt):], first[1], atol=1e-3)  # the newer weights differ
            base_tokens, base_logprobs = greedy_of(sc.create_sampling_client(base_model=MODEL))
            assert base_tokens == base_before[0] and np.allclose(base_logprobs, base_before[1], atol=1e-5)
        # ... and sent at once: each still its own, whatever the order the sampler takes them in.
        base = sc.create_sampling_client(base_model=MODEL)
        clients = [sampler, newer[-1], base, sampler, newer[0], base, newer[-1]]
        futures = [c.sample(types.ModelInput.from_ints(prompt), 1, greedy_params) for c in clients]
        results = [list(f.result().sequences[0].tokens) for f in futures]
        assert results[0] == results[3] == first[0] and results[2] == results[5] == base_before[0]
        assert results[1] == results[6] == greedy_of(newer[-1])[0]
        # Each model keeps its newest 4 saves for the sampler: the fifth save evicts the first, refused by name.
        tc.save_weights_for_sampler("named").result()
        greedy_of(newer[0])
        tc.save_weights_and_get_sampling_client().result()
        with pytest.raises(tinker.BadRequestError, match="sampling_session_id.*its weights are no longer kept"):
            greedy_of(sampler)
        greedy_of(newer[0])


def test_bad_calls_are_refused_by_field_and_change_nothing(server, arctic):
    data = sft_data()
    with service(server) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        digest = model_digest(server, tc)
        with pytest.raises(tinker.BadRequestError, match="loss_fn.*'stable_reinforce' is not supported"):
            tc.forward_backward(data, "stable_reinforce").result()
        with pytest.raises(tinker.BadRequestError, match="loss_fn_config.clip_low_threshold.*is required by gspo"):
            tc.forward_backward(data, "gspo").result()
        shifted = types.Datum(model_input=types.ModelInput.from_ints([11, 12, 13]),
                              loss_fn_inputs={"target_tokens": [12, 99, 14], "weights": [1.0, 1.0, 1.0]})
        with pytest.raises(tinker.BadRequestError, match=r"data\[1\].loss_fn_inputs.target_tokens\[1\]"):
            tc.forward_backward([data[0], shifted], "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match=r"data\[0\].loss_fn_inputs.logprobs.*required by ppo"):
            tc.forward_backward(data[:1], "ppo").result()
        with pytest.raises(tinker.BadRequestError, match="loss_fn_config.clip_low_threshold"):
            tc.forward_backward(data[:1], "ppo", {"clip_low_threshold": 1.5}).result()
        assert model_digest(server, tc) == digest
        tc.forward_backward(data, "cross_entropy").result()
        digest = model_digest(server, tc)
        # NaN and infinities reach the server as null (the SDK's JSON): refused, never a step at the last rate.
        for field, params in (("learning_rate", dict(learning_rate=float("nan"))),
                              ("learning_rate", dict(learning_rate=float("inf"))),
                              ("learning_rate", dict(learning_rate=-1e-3)),
                              ("beta2", dict(learning_rate=1e-2, beta2=1.0)),
                              ("beta1", dict(learning_rate=1e-2, beta1=-0.1)),
                              ("eps", dict(learning_rate=1e-2, eps=-1e-8)),
                              ("weight_decay", dict(learning_rate=1e-2, weight_decay=-0.1)),
                              ("grad_clip_norm", dict(learning_rate=1e-2, grad_clip_norm=float("nan")))):
            with pytest.raises(tinker.BadRequestError, match=f"adam_params.{field}"):
                tc.optim_step(types.AdamParams(**params)).result()
        assert model_digest(server, tc) == digest
        # A call this server cannot serve is refused in its turn: the calls numbered after it still run.
        with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
            tc.save_weights_external("exported", age_encryption_recipients=["age1xyz"]).result()
        assert model_digest(server, tc) == digest
        # The SDK's own defaults (eps 1e-12, betas 0.9/0.95), as the Tinker quickstart sends them, are applied.
        assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["learning_rate"] == 1e-2
        assert model_digest(server, tc) != digest
        # The refused calls took their seq_id turns: the next call runs (it waited for none of them).
        assert tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0
        # Another model, made while this one trains, starts from the base model: the job's policy, which no Tinker
        # model's training touches.
        base_loss = -sum(np.dot(row, d.loss_fn_inputs["weights"].tolist())
                         for row, d in zip(arctic.log_probs([as_sequence(d) for d in data]).logprobs, data))
        with service(server) as other:
            fresh = other.create_lora_training_client(base_model=MODEL, rank=32).result()
            assert fresh.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(base_loss, rel=1e-5)
            assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] != pytest.approx(base_loss, rel=1e-3)
    with service(server) as sc:
        with pytest.raises(tinker.BadRequestError, match="base_model"):
            sc.create_lora_training_client(base_model="other/model", rank=32).result()
        tc = sc.create_lora_training_client(base_model=MODEL, rank=32)  # free again
        tc.forward_backward(data, "cross_entropy").result()


def test_state_saved_and_loaded_through_tinker_paths(server):
    data = sft_data()
    with service(server) as sc:
        tc = trained_one_step(sc, data)
        saved = tc.save_state("after-one").result().path
        digest = model_digest(server, tc)
        loss_saved = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert saved.startswith("tinker://") and saved.endswith("/weights/after-one")
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()
        assert model_digest(server, tc) != digest
        # load_state: the saved weights, with a fresh optimizer (its moments are gone: another digest)
        tc.load_state(saved).result()
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == loss_saved
        assert model_digest(server, tc) != digest
        tc.load_state_with_optimizer(saved).result()
        assert model_digest(server, tc) == digest
        with pytest.raises(tinker.BadRequestError, match="path"):
            tc.save_state("../escape").result()
        with pytest.raises(tinker.BadRequestError, match="path"):
            tc.load_state_with_optimizer("tinker://../weights/after-one").result()
    # A new session resumes from it (the cookbook's resume path).
    with service(server) as sc:
        tc = sc.create_training_client_from_state_with_optimizer(saved).result()
        assert model_digest(server, tc) == digest
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()
    # ... or starts a new run from its weights (the cookbook's load_checkpoint_path: RL from an SFT checkpoint)
    with service(server) as sc:
        tc = sc.create_training_client_from_state(saved).result()
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == loss_saved
        assert model_digest(server, tc) != digest
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2, **ADAM)).result()


def test_the_server_token_is_the_sdks_api_key(tiny_model, tmp_path):
    config = BackendConfig.model_validate({"model_path": tiny_model, "engine": ENGINE, "sampler": LIGHT_SAMPLER})
    settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL, tinker_full_parameter=True,
                              token="tml-s3cret", checkpoint_dir=str(tmp_path))
    with ServerThread(settings, config) as url:
        with service(url, "tml-s3cret") as sc:
            sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        with pytest.raises(tinker.AuthenticationError):
            with service(url, "tml-wrong") as sc:
                sc.create_lora_training_client(base_model=MODEL, rank=32).result()
        # Signed download URLs are the one thing fetched without the token: their own token is the capability
        import httpx

        with service(url, "tml-s3cret") as sc:
            tc = sc.create_lora_training_client(base_model=MODEL, rank=32).result()
            path = tc.save_weights_external("out").result().path
            urls = sc.create_rest_client().get_external_weights_urls(path).result().urls
        assert httpx.get(urls["config.json"]).status_code == 200
        token = urls["config.json"].split("/signed/")[1].split("/")[0]
        assert httpx.get(urls["config.json"].replace(token, "x" * len(token))).status_code == 404
        assert httpx.get(urls["config.json"].replace("config.json", "../../../config.json")).status_code in (401, 404)
        assert httpx.post(urls["config.json"], json={}).status_code == 401  # GETs only
        assert httpx.get(f"{url}/api/v1/training_runs").status_code == 401


def test_a_lora_client_is_refused_on_a_full_parameter_job_unless_the_server_allows_it(tiny_model, tmp_path):
    config = BackendConfig.model_validate({"model_path": tiny_model, "engine": ENGINE, "sampler": LIGHT_SAMPLER})
    with ServerThread(ServerSettings(port=free_loopback_port(), served_model_name=MODEL,
                                     checkpoint_dir=str(tmp_path)), config) as url:
        with service(url) as sc:
            with pytest.raises(tinker.BadRequestError, match="lora_config.rank.*--tinker-full-parameter"):
                sc.create_lora_training_client(base_model=MODEL, rank=32).result()


def test_calls_start_in_seq_id_order_whatever_order_they_arrive_in():
    started = []
    order = SeqOrder()
    for seq in (3, 2):
        order.admit(seq, lambda seq=seq: started.append(seq))
    assert started == []  # 1 has not arrived
    order.admit(1, lambda: started.append(1))
    assert started == [1, 2, 3]
    with pytest.raises(InvalidRequest, match="seq_id"):
        order.admit(2, lambda: None)


def test_a_lora_job_trains_adapters_of_the_rank_asked(tiny_model, tmp_path):
    """A model trains the job's adapter at the rank it asks (up to the job's); the next model starts from the base
    model again, at its own rank."""
    config = BackendConfig.model_validate({"model_path": tiny_model, "engine": {**ENGINE, "lora": {"r": 8}},
                                           "sampler": LIGHT_SAMPLER})
    with ServerThread(ServerSettings(port=free_loopback_port(), served_model_name=MODEL,
                                     checkpoint_dir=str(tmp_path)), config) as url:
        with service(url) as sc:
            with pytest.raises(tinker.BadRequestError, match="lora_config.rank.*must be 1 to 8.*not 32"):
                sc.create_lora_training_client(base_model=MODEL, rank=32).result()
            tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
            assert tc.get_info().is_lora and tc.get_info().lora_rank == 4
            losses = []
            for _ in range(3):
                losses.append(tc.forward_backward(sft_data(), "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=5e-2, **ADAM)).result()
            assert losses[-1] < losses[0], losses
            trained = losses[-1]
        # A new model after a trained one starts from the base model, at any rank it asks for.
        with service(url) as sc:
            tc = sc.create_lora_training_client(base_model=MODEL, rank=2).result()
            assert tc.get_info().lora_rank == 2
            loss = tc.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
            assert loss == pytest.approx(losses[0], rel=1e-6) and loss != pytest.approx(trained, rel=1e-3)


def test_the_rest_client_lists_a_tenants_runs_checkpoints_and_sessions_and_deletes_checkpoints(server):
    data = sft_data()
    with service(server) as sc:
        tc = trained_one_step(sc, data, user_metadata={"recipe": "sft"})
        state_path = tc.save_state("after-one").result().path
        sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
        rc = sc.create_rest_client()
        run_id = state_path.split("/")[2]
        runs = rc.list_training_runs().result()
        run = runs.training_runs[0]  # newest first
        assert runs.cursor.total_count == len(runs.training_runs) >= 1
        assert run.training_run_id == run_id and run.base_model == MODEL and run.model_owner
        assert run.last_checkpoint.tinker_path == state_path and run.user_metadata == {"recipe": "sft"}
        assert run.last_sampler_checkpoint.tinker_path == sampler_path
        assert rc.get_training_run(run_id).result() == run
        assert rc.get_training_run_by_tinker_path(state_path).result().training_run_id == run_id
        listed = rc.list_checkpoints(run_id).result().checkpoints
        assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
            ("weights/after-one", "training"), ("sampler_weights/for-sampling", "sampler")]
        assert listed[0].size_bytes > 0 and not listed[0].public and listed[0].expires_at is None
        user = rc.list_user_checkpoints().result()
        assert [c.tinker_path for c in user.checkpoints[:2]] == [sampler_path, state_path]  # newest first
        assert user.cursor.total_count == len(user.checkpoints)
        session_id = run_id.split(":")[0]
        assert rc.get_session(session_id).result().training_run_ids == [run_id]
        assert session_id in rc.list_sessions().result().sessions
        # Another tenant (another key) sees none of it
        with service(server, "tml-someone-else") as other:
            other_rc = other.create_rest_client()
            assert other_rc.list_training_runs().result().training_runs == []
            with pytest.raises(tinker.NotFoundError):
                other_rc.get_training_run(run_id).result()
            with pytest.raises(tinker.NotFoundError):
                other_rc.delete_checkpoint_from_tinker_path(state_path).result()
        with pytest.raises(tinker.BadRequestError):  # nothing is published (a 400: the SDK retries a 409)
            rc.publish_checkpoint_from_tinker_path(state_path).result()
        rc.delete_checkpoint_from_tinker_path(state_path).result()
        rc.delete_checkpoint_from_tinker_path(sampler_path).result()
        assert rc.list_checkpoints(run_id).result().checkpoints == []
        with pytest.raises(tinker.NotFoundError):
            tc.load_state(state_path).result()
        with pytest.raises(tinker.NotFoundError):
            rc.delete_checkpoint_from_tinker_path(state_path).result()


def test_exported_weights_download_through_signed_urls_and_give_the_trainers_log_probs(server, tmp_path):
    """save_weights_external then get_external_weights_urls, as `tinker checkpoint download` does: each file fetched
    by a plain GET without the API key; the folder loads in transformers and scores as the trainer does."""
    import httpx
    from transformers import AutoModelForCausalLM

    data = sft_data()
    with service(server) as sc:
        tc = trained_one_step(sc, data)
        exported = tc.save_weights_external("exported").result().path
        assert exported.endswith("/external_weights/exported")
        trainer = [out["logprobs"].to_torch() for out in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
        rc = sc.create_rest_client()
        urls = rc.get_external_weights_urls(exported).result().urls
        assert "config.json" in urls and any(name.endswith(".safetensors") for name in urls)
        for name, url in urls.items():
            response = httpx.get(url)  # no key
            assert response.status_code == 200, (name, response.text)
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(response.content)
        assert httpx.get(next(iter(urls.values())).replace("/signed/", "/signed/x")).status_code == 404
        model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
        for d, expected in zip(data, trainer):
            tokens = torch.tensor([d.model_input.to_ints()])
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data)
            with torch.no_grad():
                scored = torch.log_softmax(model(tokens).logits[0].float(), -1).gather(1, targets[:, None])[:, 0]
            torch.testing.assert_close(scored, expected.float(), rtol=1e-5, atol=1e-5)
        listed = {c.checkpoint_id: c for c in rc.list_checkpoints(exported.split("/")[2]).result().checkpoints}
        assert listed["external_weights/exported"].checkpoint_type == "external"
        with pytest.raises(tinker.BadRequestError):  # a name already exported
            tc.save_weights_external("exported").result()
        rc.set_checkpoint_ttl_from_tinker_path(exported, 3600).result()
        assert rc.list_checkpoints(exported.split("/")[2]).result().checkpoints[-1].expires_at is not None
        rc.delete_checkpoint_from_tinker_path(exported).result()
        with pytest.raises(tinker.NotFoundError):
            rc.get_external_weights_urls(exported).result()


def test_a_job_that_trained_before_its_first_tinker_model_keeps_no_base(tiny_model, tmp_path):
    """Tinker models start from the job's policy as the first found it, and sample the base while the sampler holds
    it. A job whose own policy trained and synced before then kept no base weights: a base-model sampling client is
    refused as it is made, saying why, and so is a LoRA shape other than the job's adapter."""
    config = BackendConfig.model_validate({"model_path": tiny_model, "engine": {**ENGINE, "lora": {"r": 8}},
                                           "sampler": LIGHT_SAMPLER})
    settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL, checkpoint_dir=str(tmp_path))
    prompt = types.ModelInput.from_ints([11, 12, 13])
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=0)
    with ServerThread(settings, config) as url, service(url) as sc:
        arctic = ArcticRLClient(url, retries=0)
        arctic.fwd_bwd([as_sequence(d) for d in sft_data()], "sft")
        arctic.step()
        arctic.sync_weights()
        with pytest.raises(tinker.BadRequestError, match="base_model.*trained or synced before the first"):
            sc.create_sampling_client(base_model=MODEL).sample(prompt, 1, params).result()
        with pytest.raises(tinker.BadRequestError, match="lora_config.*trained before its first Tinker model"):
            sc.create_lora_training_client(base_model=MODEL, rank=4).result()
        tc = sc.create_lora_training_client(base_model=MODEL, rank=8).result()
        assert len(tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
                   .sequences[0].tokens) == 3
