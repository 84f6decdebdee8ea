"""The trainer side of prime-rl against prime-rl's own code: its packer and senders produce the batches, its loss
functions are the reference.

- Wire: prime-rl's `prepare_batch` packs samples (several per row, padding, dummy rows); its encoder writes them;
  the adapter's reader gives back every sample exactly, grouped by prompt.
- Transports: prime-rl's ZMQ sender (READY handshake) and filesystem sender deliver to the adapter's receivers.
- Losses: `primerl_default` and `primerl_ipo` against prime-rl's `compute_loss` with `default_loss_fn` and
  `ipo_loss_fn` on those batches: loss and gradient within 1e-6 (fp32).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.losses.inputs import LossInputs
from arctic_rl_core.losses.primerl import PrimeRLDefaultConfig, PrimeRLIPOConfig, primerl_default_loss, primerl_ipo_loss
from arctic_rl_primerl.batches import decode, step_batch

VOCAB = 200


def training_samples(seed: int, groups: int = 3, group_size: int = 4, turns: bool = True):
    """GRPO groups as prime-rl's orchestrator stamps them: a shared prompt, sampled tokens masked in, per-token
    inference log-probs and the rollout's advantage broadcast over the completion; some multi-turn samples with a
    context span (mask off) between two sampled spans."""
    from prime_rl.transports.rollouts.types import TrainingSample

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 12))]
        for _ in range(group_size):
            completion = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 9))]
            mask = [False] * len(prompt) + [True] * len(completion)
            if turns and rng.random() < 0.5:
                context = [rng.randrange(1, VOCAB) for _ in range(3)]
                second = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))]
                completion += context + second
                mask += [False] * len(context) + [True] * len(second)
            tokens = prompt + completion
            advantage = rng.uniform(-1, 1)
            samples.append(TrainingSample(
                token_ids=tokens, mask=mask,
                logprobs=[-rng.uniform(0.05, 3.0) if m else 0.0 for m in mask],
                temperatures=[1.0] * len(tokens), env_name=f"env{g % 2}",
                advantages=[advantage if m else 0.0 for m in mask]))
    return samples


def packed(samples, workers: int = 1, pad_to: int = 8):
    from prime_rl.trainer.batch import build_bin_cost, prepare_batch

    return prepare_batch(rollouts=samples, seq_len=64, num_train_workers=workers, bin_cost=build_bin_cost(None),
                         pad_to_multiple_of=pad_to)


def encoded(micro_batches) -> bytes:
    import msgspec

    return msgspec.msgpack.Encoder().encode(micro_batches)


def test_no_import_only_stub_is_on_the_path_of_a_batch_or_a_loss():
    """prime-rl's packer, transports and loss import no stub (stubs/README.md): checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys, prime_rl.trainer.batch, prime_rl.transports.rollouts, prime_rl.trainer.rl.loss; "
            "print([m for m, mod in list(sys.modules.items()) if 'primerl-stubs' in (getattr(mod, '__file__', '') or '')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_reader_gives_back_every_sample_prime_rl_packed_grouped_by_prompt():
    samples = training_samples(0)
    grid = packed(samples)
    assert len(grid) == 1 and any(len(mb.sequence_lengths) > 1 for mb in grid[0])  # several samples share rows
    batch = step_batch(decode(encoded(grid[0])), VOCAB)
    assert batch.samples == len(samples)
    sequences = batch.by_temperature[1.0]
    got = sorted((tuple(s.prompt_ids + s.response_ids), tuple(s.loss_mask), tuple(s.behaviour_logprobs),
                  tuple(s.advantages)) for s in sequences)
    want = []
    for sample in samples:
        first = sample.mask.index(True)
        want.append((tuple(sample.token_ids), tuple(1.0 if m else 0.0 for m in sample.mask[first:]),
                     tuple(sample.logprobs[first:]), tuple(sample.advantages[first:])))
    assert got == sorted(want)
    by_prompt = {}
    for s in sequences:
        by_prompt.setdefault(tuple(s.prompt_ids), set()).add(s.group_id)
    assert len(by_prompt) == 3 and all(len(ids) == 1 for ids in by_prompt.values())
    assert len({s.group_id for s in sequences}) == 3
    assert batch.envs == {"env0": 8, "env1": 4}


def routed(samples, layers: int = 2, top_k: int = 2, experts: int = 4, seed: int = 0):
    """The samples with routed experts as verifiers attaches them: one uint8 row per token, distinct experts."""
    import numpy as np
    from prime_rl.transports.rollouts.types import RoutedExperts

    rng = np.random.default_rng(seed)
    for sample in samples:
        ids = np.argsort(rng.random((len(sample.token_ids), layers, experts)), axis=-1)[..., :top_k].astype(np.uint8)
        sample.routed_experts = RoutedExperts(data=ids.tobytes(), shape=list(ids.shape), dtype="uint8")
    return samples


def test_with_router_replay_each_sequence_carries_its_samples_routed_experts_from_prime_rls_packer():
    import numpy as np

    samples = routed(training_samples(2))
    grid = packed(samples)
    want = {tuple(s.token_ids): np.frombuffer(s.routed_experts.data, np.uint8).reshape(s.routed_experts.shape)
            for s in samples}
    sequences = step_batch(decode(encoded(grid[0])), VOCAB, replay=True).by_temperature[1.0]
    assert len(sequences) == len(samples)
    for seq in sequences:
        assert np.array_equal(seq.routed_experts.array(), want[tuple(seq.prompt_ids + seq.response_ids)])
    # Replay off: prime-rl's trainer drops the routes, and so does this one.
    assert all(s.routed_experts is None for s in step_batch(decode(encoded(grid[0])), VOCAB).by_temperature[1.0])
    # Replay on and a row without routes (its inference server returned none): refused by field.
    plain = packed(training_samples(2))
    with pytest.raises(InvalidRequest, match="enable_router_replay") as err:
        step_batch(decode(encoded(plain[0])), VOCAB, replay=True)
    assert err.value.field == "micro_batches[0].routed_experts"
    row = grid[0][0]
    row.routed_experts.shape = [row.routed_experts.shape[0] - 1, *row.routed_experts.shape[1:]]
    with pytest.raises(InvalidRequest) as err:
        step_batch(decode(encoded(grid[0])), VOCAB, replay=True)
    assert err.value.field == "micro_batches[0].routed_experts.shape"


def test_what_the_trainer_cannot_do_is_refused_by_field_before_any_work():
    grid = packed(training_samples(1))
    row = grid[0][0]
    row.rl_weights = [0.5] * len(row.input_ids)
    with pytest.raises(InvalidRequest, match="only weights 0 and 1") as err:
        step_batch(decode(encoded(grid[0])), VOCAB)
    assert err.value.field == "micro_batches[0].rl_weights[0]"
    row.rl_weights = None
    with pytest.raises(InvalidRequest, match="outside the model's vocabulary"):
        step_batch(decode(encoded(grid[0])), 10)
    with pytest.raises(InvalidRequest, match="micro_batches"):
        decode(b"not msgpack")


def test_prime_rls_zmq_sender_reaches_the_receiver_after_its_ready_handshake(tmp_path):
    from prime_rl.configs.shared import ZMQTransportConfig
    from prime_rl.transports.rollouts import ZMQMicroBatchSender

    from arctic_rl_primerl.transport import ZMQReceiver
    from compat_tests.main_server import free_port

    transport = ZMQTransportConfig(port=free_port())
    steps = [packed(training_samples(seed)) for seed in (2, 3)]

    async def send():
        sender = ZMQMicroBatchSender(tmp_path, 1, 1, transport)
        try:
            for grid in steps:
                await sender.send(grid)  # the first send waits for the receiver's READY
        finally:
            await asyncio.sleep(0.5)  # PUB drops what is queued at close
            sender.close()

    # The receiver first, as when the trainer starts before the orchestrator: its subscription must reach the
    # publisher before READY lets it send step 1.
    receiver = ZMQReceiver(transport.host, transport.port, transport.hwm)
    failed = []
    thread = threading.Thread(target=lambda: _record_failure(lambda: asyncio.run(send()), failed), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    try:
        got = [receiver.receive(step, lambda: time.monotonic() > deadline) for step in (1, 2)]
    finally:
        receiver.close()
        thread.join(30)
    assert not failed, failed
    assert [encoded(g) for g in got] == [encoded(grid[0]) for grid in steps]


def _record_failure(fn, failed: list) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - reported by the test's thread
        failed.append(repr(err))


def test_prime_rls_filesystem_sender_reaches_the_receiver(tmp_path):
    from prime_rl.transports.rollouts import FileSystemMicroBatchSender

    from arctic_rl_primerl.transport import FileSystemReceiver

    grid = packed(training_samples(4))
    asyncio.run(FileSystemMicroBatchSender(tmp_path, 1, current_step=1).send(grid))
    receiver = FileSystemReceiver(tmp_path)
    assert encoded(receiver.receive(1, lambda: False)) == encoded(grid[0])
    assert receiver.receive(2, lambda: True) is None  # not there yet, and stopping


def _prime_rl_loss(micro_batches, trainer_logprobs, loss_config):
    """prime-rl's trainer's loss on the micro-batches: `compute_loss` per row, normalised by the step's token count."""
    from prime_rl.trainer.rl.loss import compute_loss, setup_rl_loss_fn

    rl_loss_fn = setup_rl_loss_fn(loss_config)
    scale = max(sum(sum(mb.loss_mask) for mb in micro_batches), 1)
    total = 0.0
    for mb, logp in zip(micro_batches, trainer_logprobs):
        split = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype).split(mb.sequence_lengths)  # noqa: E731
        loss, _ = compute_loss(
            trainer_logprobs=list(logp.split(mb.sequence_lengths)), inference_logprobs=list(split(mb.inference_logprobs)),
            ref_logprobs=None, advantages=list(split(mb.advantages)), loss_mask=list(split(mb.loss_mask, torch.bool)),
            rl_weights=None, ce_weights=None, ref_kl_weights=None, rl_loss_fn=rl_loss_fn,
            rl_scale=scale, ce_scale=1, ref_kl_scale=1)
        total = total + loss
    return total


def _ours(micro_batches, trainer_logprobs, loss_fn, config):
    """The adapter's sequences with the same per-token log-probs, flattened over response tokens as the engine hands
    them to a loss, and our loss on them; gradients flow back to the same packed tensors."""
    batch = step_batch(micro_batches, VOCAB)
    sequences = batch.by_temperature[1.0]
    # Each packed token's trainer log-prob, found again by the sample's tokens (samples are unique here).
    where = {}
    for mb, logp in zip(micro_batches, trainer_logprobs):
        starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [len(mb.input_ids)]
        for a, b in zip(starts, starts[1:]):  # padding extends the last sample's length but restarts positions
            where[tuple(mb.input_ids[a:b])] = logp[a:b]
    pieces, seq_index, group_index = [], [], []
    for i, s in enumerate(sequences):
        full = where[tuple(s.prompt_ids + s.response_ids)]
        pieces.append(full[len(s.prompt_ids):])
        seq_index += [i] * len(s.response_ids)
        group_index += [int(s.group_id)] * len(s.response_ids)
    cat = lambda name: torch.tensor([v for s in sequences for v in getattr(s, name)], dtype=torch.float32)  # noqa: E731
    mask = cat("loss_mask")
    seq_index, group_index = torch.tensor(seq_index), torch.tensor(group_index)
    seq_tokens = torch.zeros(len(sequences)).index_add_(0, seq_index, mask)
    group_tokens = torch.zeros(int(group_index.max()) + 1).index_add_(0, group_index, mask)
    inputs = LossInputs(loss_mask=mask, seq_index=seq_index, group_index=group_index, seq_tokens=seq_tokens,
                        group_tokens=group_tokens, num_tokens=float(mask.sum()),
                        num_sequences=int((seq_tokens > 0).sum()), num_groups=int((group_tokens > 0).sum()),
                        weight_version=0, advantages=cat("advantages"), behaviour_logprobs=cat("behaviour_logprobs"))
    loss, _ = loss_fn({"logprobs": torch.cat(pieces)}, inputs, config)
    return loss


CASES = [
    ("default", {}, primerl_default_loss, PrimeRLDefaultConfig),
    ("default", {"dppo_mask_low": 0.05, "dppo_mask_high": 0.1, "adv_tau": 0.7, "kl_tau": 0.05}, primerl_default_loss,
     PrimeRLDefaultConfig),
    ("ipo", {}, primerl_ipo_loss, PrimeRLIPOConfig),
    ("ipo", {"ipo_threshold": 0.03, "adv_tau": 1.5, "kl_tau": 0.1}, primerl_ipo_loss, PrimeRLIPOConfig),
]


@pytest.mark.parametrize("kind, settings, loss_fn, config_type", CASES)
@pytest.mark.parametrize("seed", [5, 6])
def test_losses_match_prime_rls_own_on_its_packed_batches(kind, settings, loss_fn, config_type, seed):
    from prime_rl.configs.trainer import DefaultLossConfig, IPOLossConfig

    micro_batches = decode(encoded(packed(training_samples(seed), pad_to=8)[0]))
    g = torch.Generator().manual_seed(seed)
    # Trainer log-probs moved from the inference ones by up to +-0.6 nats, so that tokens are masked both ways.
    base = [torch.tensor(mb.inference_logprobs) + (torch.rand(len(mb.input_ids), generator=g) - 0.5) * 1.2
            for mb in micro_batches]
    base = [b.clamp(max=-1e-3) for b in base]
    theirs_logp = [b.clone().requires_grad_(True) for b in base]
    ours_logp = [b.clone().requires_grad_(True) for b in base]
    reference = (DefaultLossConfig if kind == "default" else IPOLossConfig)(**settings)
    theirs = _prime_rl_loss(micro_batches, theirs_logp, reference)
    ours = _ours(micro_batches, ours_logp, loss_fn, config_type(**settings))
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    theirs.backward()
    ours.backward()
    for a, b, mb in zip(ours_logp, theirs_logp, micro_batches):
        # prime-rl's gradient on untrained tokens is 0 like ours; compare everything.
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-6), (a.grad - b.grad).abs().max()
    masked = sum(1 for mb, b in zip(micro_batches, base) for m in mb.loss_mask if m)
    assert masked > 20


@pytest.fixture(scope="module")
def trainer_server(tiny_model, tmp_path_factory):
    """A server of its own (the rollout tests' server keeps its weights), with prime-rl's AdamW defaults."""
    from compat_tests.main_server import serving_light

    engine = {"learning_rate": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "grad_clip": 1.0}
    with serving_light(tiny_model, tmp_path_factory.mktemp("trainer-server"), engine) as url:
        yield url


def _trainer_config(model_path: str, output_dir, max_steps: int, **fields):
    """prime-rl's TrainerConfig as its TOML would give it; `fields` replace whole sections."""
    from prime_rl.configs.trainer import TrainerConfig

    return TrainerConfig.model_validate({"model": {"name": model_path}, "optim": {"type": "adamw", "lr": 1e-3},
                                         "output_dir": str(output_dir), "max_steps": max_steps,
                                         "rollout_transport": {"type": "filesystem"}, **fields})


def test_the_trainer_trains_what_prime_rl_sends_with_prime_rls_loss_and_publishes_each_step(
        trainer_server, tiny_model, tmp_path):
    """Two steps sent by prime-rl's filesystem sender: the loss the trainer reports is prime-rl's `compute_loss` on
    the server's own log-probs before the step (within 1e-5), each step is published after the sampler synced, and
    ZoRRo computes each shared prompt once."""
    import json

    from prime_rl.transports.rollouts import FileSystemMicroBatchSender

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_primerl.trainer import Settings, run
    from prime_rl.configs.trainer import DefaultLossConfig

    client = ArcticRLClient(trainer_server, retries=0)
    vocab = client.status()["backend"]["model"]["vocab_size"]
    assert vocab >= VOCAB
    steps = [packed(training_samples(seed, turns=False)) for seed in (7, 8)]
    first = decode(encoded(steps[0][0]))
    sequences = step_batch(first, VOCAB).by_temperature[1.0]
    response_logprobs = client.log_probs(sequences).logprobs
    by_tokens = {tuple(s.prompt_ids + s.response_ids): (len(s.prompt_ids), lp) for s, lp in zip(sequences, response_logprobs)}
    trainer_logprobs = []
    for mb in first:
        row = [0.0] * len(mb.input_ids)
        starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [len(mb.input_ids)]
        for a, b in zip(starts, starts[1:]):
            found = by_tokens.get(tuple(mb.input_ids[a:b]))
            if found is not None:
                prompt_len, lp = found
                row[a + prompt_len:b] = lp
        trainer_logprobs.append(torch.tensor(row))
    expected = float(_prime_rl_loss(first, trainer_logprobs, DefaultLossConfig()))
    version = client.weight_version

    async def send():
        sender = FileSystemMicroBatchSender(tmp_path, 1, current_step=1)
        for grid in steps:
            await sender.send(grid)
    asyncio.run(send())
    assert run(_trainer_config(tiny_model, tmp_path, 2), Settings(trainer_server)) == 2

    records = [json.loads(line) for line in (tmp_path / "arctic_rl_trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["loss"] - expected) <= 1e-5 * max(1.0, abs(expected)), (records[0]["loss"], expected)
    assert [r["weight_version"] for r in records] == [version + 1, version + 2] and client.weight_version == version + 2
    for step, weight_version in ((0, version), (1, version + 1), (2, version + 2)):
        folder = tmp_path / "broadcasts" / f"step_{step}"
        assert (folder / "STABLE").exists()
        assert json.loads((folder / "arctic_rl.json").read_text()) == {"step": step, "weight_version": weight_version}
    assert all(r["computed_tokens"] < r["unshared_tokens"] for r in records)
    assert records[0]["samples"] == 12 and records[0]["trained_tokens"] == sum(sum(mb.loss_mask) for mb in first)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """A tiny Qwen3-MoE job replaying routing (R3): its vLLM sampler records each completion's routes."""
    from arctic_rl_core.models.tiny import make_tiny_model
    from compat_tests.main_server import serving

    work = tmp_path_factory.mktemp("moe-server")
    model = make_tiny_model("qwen3_moe", str(work / "model"), max_positions=256)
    job = {"model_path": model, "router_replay": "R3",
           "engine": {"learning_rate": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "grad_clip": 1.0}}
    with serving(job, work) as url:
        yield url, model


def test_enable_router_replay_trains_on_the_samplers_routing(moe_server, tmp_path):
    """prime-rl's trainer config with `enable_router_replay`: batches prime-rl packs from samples whose routes the
    job's sampler recorded train with those routes (the trainer's routing is the sampler's: log-probs replaying them
    equal the sampled ones), and its loss is prime-rl's on those log-probs."""
    import numpy as np
    from prime_rl.configs.trainer import DefaultLossConfig
    from prime_rl.transports.rollouts import FileSystemMicroBatchSender
    from prime_rl.transports.rollouts.types import RoutedExperts, TrainingSample

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_primerl.trainer import Settings, run

    url, model = moe_server
    client = ArcticRLClient(url, retries=0)
    assert client.status()["backend"]["router_replay"] == "R3"
    prompt = [5, 6, 7, 8, 9, 10, 11]
    completions = client.generate([prompt], {"n": 4, "max_tokens": 6, "seed": 3, "ignore_eos": True})
    samples = []
    for i, c in enumerate(completions):
        tokens = prompt + c.token_ids
        routes = c.routed_experts.array()
        routes = np.concatenate([routes, routes[-1:]]).astype(np.uint8)  # verifiers repeats the last row
        samples.append(TrainingSample(
            token_ids=tokens, mask=[False] * len(prompt) + [True] * len(c.token_ids),
            logprobs=[0.0] * len(prompt) + c.logprobs, temperatures=[1.0] * len(tokens), env_name="env",
            advantages=[0.0] * len(prompt) + [1.0 - i] * len(c.token_ids),
            routed_experts=RoutedExperts(data=routes.tobytes(), shape=list(routes.shape), dtype="uint8")))
    grid = packed(samples)
    sequences = step_batch(decode(encoded(grid[0])), VOCAB * 10, replay=True).by_temperature[1.0]
    scored = client.log_probs(sequences)
    for seq, taken, lp in zip(sequences, scored.routed_experts, scored.logprobs):
        assert np.array_equal(taken.array(), seq.routed_experts.array())  # the trainer routed as the sampler did
        sampled = next(c for c in completions if prompt + c.token_ids == seq.prompt_ids + seq.response_ids)
        np.testing.assert_allclose(lp, sampled.logprobs, atol=2e-5)
    trainer_logprobs = []
    by_tokens = {tuple(s.prompt_ids + s.response_ids): (len(s.prompt_ids), lp) for s, lp in zip(sequences, scored.logprobs)}
    for mb in grid[0]:
        row = [0.0] * len(mb.input_ids)
        starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [len(mb.input_ids)]
        for a, b in zip(starts, starts[1:]):
            found = by_tokens.get(tuple(mb.input_ids[a:b]))
            if found is not None:
                row[a + found[0]:b] = found[1]
        trainer_logprobs.append(torch.tensor(row))
    expected = float(_prime_rl_loss(grid[0], trainer_logprobs, DefaultLossConfig()))

    async def send():
        await FileSystemMicroBatchSender(tmp_path, 1, current_step=1).send(grid)
    asyncio.run(send())
    assert run(_trainer_config(model, tmp_path, 1, enable_router_replay=True), Settings(url)) == 1
    import json
    record = json.loads((tmp_path / "arctic_rl_trainer.jsonl").read_text().splitlines()[0])
    assert abs(record["loss"] - expected) <= 1e-5 * max(1.0, abs(expected)), (record["loss"], expected)


def test_enable_router_replay_on_a_job_that_does_not_replay_is_refused_at_start_up(trainer_server, tiny_model, tmp_path):
    from arctic_rl_core.attach import ArcticSetupError
    from arctic_rl_primerl.trainer import Settings, run

    with pytest.raises(ArcticSetupError, match="enable_router_replay: the Arctic RL job replays no routing"):
        run(_trainer_config(tiny_model, tmp_path, 1, enable_router_replay=True), Settings(trainer_server))
    assert not (tmp_path / "broadcasts").exists()


def test_a_config_the_trainer_cannot_follow_stops_it_before_any_step_naming_each_field(trainer_server, tiny_model,
                                                                                      tmp_path):
    from arctic_rl_core.attach import ArcticSetupError
    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_primerl.trainer import Settings, run

    client = ArcticRLClient(trainer_server, retries=0)
    digest = client.state_digest()
    config = _trainer_config(tiny_model, tmp_path, 20, loss={"type": "custom", "import_path": "math.sqrt"},
                             scheduler={"type": "linear", "warmup_steps": 2}, model={"name": tiny_model, "lora": {}})
    with pytest.raises(ArcticSetupError) as err:
        run(config, Settings(trainer_server))
    for field in ("loss.type", "scheduler.type", "model.lora"):
        assert field in str(err.value)
    assert not (tmp_path / "broadcasts").exists() and client.state_digest() == digest
    other_optimizer = _trainer_config(tiny_model, tmp_path, 1, optim={"type": "adamw", "lr": 1e-3, "weight_decay": 0.5})
    with pytest.raises(ArcticSetupError, match="weight_decay"):
        run(other_optimizer, Settings(trainer_server))
    assert client.state_digest() == digest
