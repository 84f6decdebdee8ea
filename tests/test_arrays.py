"""Token ids and per-token floats as numpy arrays: kept as given, checked as lists are, and passed
from the wire to the engine as views of the request body."""

from __future__ import annotations

import abc
import asyncio
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.batching import build_micro_batches
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.server.app import Body, ServerSettings
from arctic_rl_core.server.buffers import BufferPool
from arctic_rl_core.server.run import ServerThread
from arctic_rl_core.types import FwdBwdRequest, FwdBwdResult, Sequence
from arctic_rl_core.validation import parse


def fields(seed: int, prompt: list[int] | None = None) -> dict:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 50, 5).tolist() if prompt is None else prompt
    n = int(rng.integers(2, 6))
    return {"prompt_ids": prompt, "response_ids": rng.integers(1, 50, n).tolist(),
            "advantages": rng.standard_normal(n).tolist(), "behaviour_logprobs": (-rng.random(n)).tolist(),
            "loss_mask": [1.0] * (n - 1) + [0.0], "behaviour_version": 3}


def as_arrays(seq: dict) -> dict:
    """The same sequence as a framework hands it over: int32 ids and float32 values, as in its tensors."""
    return {k: np.asarray(v, dtype=np.int32 if k.endswith("_ids") else np.float32) if isinstance(v, list) else v
            for k, v in seq.items()}


def test_a_sequence_keeps_the_arrays_it_is_given_and_dumps_them_as_lists_to_json():
    ids = np.arange(1, 6, dtype=np.int32)
    seq = Sequence(prompt_ids=ids, response_ids=[7, 8], advantages=np.ones(2, np.float32))
    assert seq.prompt_ids is ids and seq.response_ids == [7, 8]
    assert seq.model_dump()["prompt_ids"] is ids
    assert seq.model_dump(mode="json")["prompt_ids"] == [1, 2, 3, 4, 5]
    assert Sequence.model_validate_json(seq.model_dump_json()).advantages == [1.0, 1.0]


@pytest.mark.parametrize("change, field", [
    (lambda s: s.update(prompt_ids=[1, 2.5, 3]), "prompt_ids.1"),
    (lambda s: s.update(response_ids=[[1, 2], [3, 4], [5, 6]]), "response_ids.0"),
    (lambda s: s.update(advantages=[0.0, 0.0, float("nan")]), "advantages.2"),
])
def test_arrays_are_refused_where_lists_are_naming_the_same_element(change, field):
    seq = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "advantages": [0.5, 0.5, 0.5]}
    change(seq)
    array = {k: np.asarray(v) for k, v in seq.items()}
    errors = []
    for value in (seq, array):
        with pytest.raises(InvalidRequest) as err:
            parse(FwdBwdRequest, {"sequences": [value], "loss": "grpo"}, "")
        errors.append(err.value.field)
    assert errors[0] == errors[1] and errors[0].replace("[", ".").replace("]", "") == f"sequences.0.{field}", errors


@pytest.mark.parametrize("change, field", [
    (lambda s: s.update(prompt_ids=np.array([1, -2, 3])), "prompt_ids"),
    (lambda s: s.update(loss_mask=-s["loss_mask"]), "loss_mask"),
    (lambda s: s.update(behaviour_logprobs=-s["behaviour_logprobs"] + 1), "behaviour_logprobs"),
    (lambda s: s.update(advantages=s["advantages"][:-1]), "advantages"),
])
def test_array_contents_are_checked_by_field(change, field):
    seq = as_arrays(fields(1))
    change(seq)
    with pytest.raises(InvalidRequest) as err:
        Sequence.model_validate(seq).check("sequences[0]")
    assert err.value.field == f"sequences[0].{field}"


@pytest.mark.parametrize("forest", [False, True])
def test_micro_batches_from_arrays_equal_those_from_lists(forest):
    shared = list(range(1, 9))
    lists = [fields(i, prompt=shared if i < 4 else None) | {"group_id": i // 4} for i in range(7)]
    arrays = [as_arrays(s) for s in lists]
    built = [build_micro_batches([Sequence.model_validate(s) for s in batch], token_budget=40, weight_version=3,
                                 forest=forest) for batch in (lists, arrays)]
    assert len(built[0]) == len(built[1]) > 1
    for a, b in zip(*built):
        for name in ("input_ids", "attention_mask", "position_ids", "logit_rows", "targets"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or torch.equal(x, y), name
        assert a.sequence_ids == b.sequence_ids and a.response_lengths == b.response_lengths
        for name in ("loss_mask", "advantages", "behaviour_logprobs", "behaviour_version", "seq_index", "group_index"):
            x, y = getattr(a.inputs, name), getattr(b.inputs, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


class RecordingBackend(TrainingAPI):
    """`fwd_bwd` keeps the sequences it is given; every other call is refused."""

    def __init__(self):
        self.received: list[Sequence] = []

    def fwd_bwd(self, sequences, loss, **options):
        self.received = [(s.prompt_ids, s.response_ids, s.advantages, s.loss_mask) for s in sequences]
        return FwdBwdResult(loss=0.0, metrics={}, num_tokens=0, num_sequences=len(sequences), computed_tokens=0,
                            weight_version=0)


def _refused(self, *args, **kwargs):
    raise NotImplementedError


for _name in RecordingBackend.__abstractmethods__ - {"fwd_bwd"}:
    setattr(RecordingBackend, _name, _refused)
abc.update_abstractmethods(RecordingBackend)


def test_the_server_hands_the_engine_views_of_the_request_body_not_lists():
    backend = RecordingBackend()
    # at least 8 entries each: shorter lists travel as JSON numbers (wire.py)
    batch = [fields(i, prompt=list(range(1, 13))) for i in range(3)]
    for seq in batch:
        for name in ("response_ids", "advantages", "behaviour_logprobs", "loss_mask"):
            seq[name] = seq[name] * 4
    with ServerThread(ServerSettings(port=free_loopback_port()), backend_factory=lambda config: backend) as url:
        client = ArcticRLClient(url, retries=0)
        client.initialize({"model_path": "unused"})
        client.fwd_bwd(batch, "grpo")
        client.close()
    assert len(backend.received) == 3
    for (prompt, response, advantages, mask), sent in zip(backend.received, batch):
        for value, expected in ((prompt, sent["prompt_ids"]), (response, sent["response_ids"]),
                                (advantages, sent["advantages"]), (mask, sent["loss_mask"])):
            assert isinstance(value, np.ndarray) and not value.flags.owndata  # a view, not a copy
            np.testing.assert_allclose(value, expected, rtol=1e-6)
        assert prompt.dtype == np.int32 and advantages.dtype == np.float32


class _StreamedRequest:
    """What `Body` reads from a Starlette request: its headers and its body in pieces."""

    def __init__(self, data: bytes):
        self.data = data
        self.headers = {"content-length": str(len(data))}

    async def stream(self):
        for start in range(0, len(self.data), 1 << 16):
            yield self.data[start : start + (1 << 16)]


def test_a_body_buffer_goes_back_to_the_pool_only_when_the_call_reading_it_is_done():
    size = 2 << 20  # pooled sizes only
    pool = BufferPool(max_pooled_bytes=8 * size)
    work = Future()

    async def serve():
        body = Body(_StreamedRequest(b"x" * size), cap=4 * size, pool=pool, timeout_s=5)
        async with body as view:
            assert bytes(view[:3]) == b"xxx"
            body.read_by(work)
        return body.buffer

    buffer = asyncio.run(serve())
    assert pool.acquire(size) is not buffer  # still being read: a new request may not overwrite it
    work.set_result(None)
    assert pool.acquire(size) is buffer
