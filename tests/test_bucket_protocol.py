"""The bucketed sync protocol between trainer and vLLM worker, without vLLM: two gloo group members in
two threads of this process, over the wire or through shared-memory slots."""

import errno
import os
import threading
import types

import pytest
import torch

from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.samplers import bucket_protocol
from arctic_rl_core.samplers.bucket_protocol import BucketSender, SharedSlot, join_group, receive_buckets


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(rows, 16, generator=g)) for i, rows in enumerate((3, 40, 5, 70, 2, 9))]


@pytest.fixture
def groups():
    port = free_loopback_port()
    made = {}

    def join(rank):
        made[rank] = join_group("127.0.0.1", port, rank, timeout_s=30, is_master=rank == 0, nccl=False)

    worker = threading.Thread(target=join, args=(1,))
    worker.start()
    join(0)
    worker.join(30)
    return made[0][0], made[1][0]


def _sync(groups, trainer, worker, weights, shared_memory, stop_after=None):
    """One sync; the worker side stops reading after `stop_after` tensors (a failed load)."""
    received = []

    def receive():
        stream = receive_buckets(groups[1], worker, copy=True)
        try:
            for name, tensor in stream:
                received.append((name, tensor))
                if stop_after is not None and len(received) == stop_after:
                    raise RuntimeError("the loader failed")
        except RuntimeError:
            pass
        finally:
            stream.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = BucketSender(groups[0], bucket_bytes=2048, owner=trainer, shared_memory=shared_memory)
    for name, tensor in weights:
        sender.add(name, tensor)
    sender.close()
    thread.join(30)
    assert not thread.is_alive()
    return received


def _arctic_files():
    return sorted(f for f in os.listdir(bucket_protocol._shared_memory_dir()) if f.startswith("arctic-rl-sync-"))


@pytest.mark.parametrize("shared_memory", [False, True])
def test_every_tensor_arrives_intact_sync_after_sync(groups, shared_memory):
    trainer, worker = types.SimpleNamespace(), types.SimpleNamespace()
    before = _arctic_files()
    for seed in range(3):  # later syncs reuse the buffers and slots of the first
        weights = _weights(seed)
        received = _sync(groups, trainer, worker, weights, shared_memory)
        assert [n for n, _ in received] == [n for n, _ in weights]
        for (_, sent), (_, got) in zip(weights, received):
            assert torch.equal(sent, got)
    assert _arctic_files() == before  # slots are unlinked once the worker has mapped them
    if shared_memory:
        assert len(worker._arctic_mapped_slots) == 2


def test_a_tensor_larger_than_a_bucket_replaces_its_slot_and_the_worker_keeps_the_live_ones(groups):
    trainer, worker = types.SimpleNamespace(), types.SimpleNamespace()
    _sync(groups, trainer, worker, _weights(0), shared_memory=True)
    big = _weights(1) + [("big", torch.randn(100, 16))]  # 6.4 KB > the 2 KB bucket
    received = _sync(groups, trainer, worker, big, shared_memory=True)
    assert torch.equal(received[-1][1], big[-1][1])
    received = _sync(groups, trainer, worker, _weights(2), shared_memory=True)  # and the next sync still works
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_weights(2), received))
    live = {slot.path for slot in trainer._arctic_shared_slots}
    assert set(worker._arctic_mapped_slots) <= live  # replaced slots are no longer mapped


@pytest.mark.parametrize("shared_memory", [False, True])
def test_a_failed_load_drains_the_trainers_buckets_and_the_next_sync_is_in_step(groups, shared_memory):
    trainer, worker = types.SimpleNamespace(), types.SimpleNamespace()
    received = _sync(groups, trainer, worker, _weights(0), shared_memory, stop_after=2)
    assert len(received) == 2  # the trainer's close() returned: it was not left waiting for acks
    received = _sync(groups, trainer, worker, _weights(1), shared_memory)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_weights(1), received))


def test_too_little_shared_memory_is_a_clear_error_and_leaves_no_file(monkeypatch):
    before = _arctic_files()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ArcticRLError, match=r"sampler.sync: no room for 64 MB .*broadcast"):
        SharedSlot(64 * 2**20)
    assert _arctic_files() == before


def test_the_plain_layout_is_only_for_dense_unquantized_architectures():
    from arctic_rl_core.samplers.vllm_plain_weights import _plain

    def config(architectures, quantization=None):
        return types.SimpleNamespace(architectures=architectures, quantization=quantization)

    assert _plain(config(["Qwen3ForCausalLM"])) and _plain(config(["LlamaForCausalLM"]))
    assert not _plain(config(["Qwen3MoeForCausalLM"]))
    assert not _plain(config(["Qwen3ForCausalLM"], quantization="fp8"))
    assert not _plain(config([]))


def test_a_bucket_stored_for_the_object_store_loads_back_bit_for_bit_in_every_dtype_and_layout():
    """`stored_buckets`: the object-store route's buckets travel as byte arrays (numpy: Ray's out-of-band path)."""
    import numpy as np

    from arctic_rl_core.samplers.stored_buckets import loaded, stored

    bucket = [("w", torch.randn(3, 4)), ("bf16", torch.randn(5).to(torch.bfloat16)), ("half", torch.randn(2, 2).half()),
              ("step", torch.tensor(7)), ("strided", torch.randn(4, 6)[:, ::2]), ("empty", torch.zeros(0, 3))]
    sent = stored(bucket)
    assert all(isinstance(data, np.ndarray) and data.dtype == np.uint8 for *_, data in sent)
    back = loaded(sent)
    assert [name for name, _ in back] == [name for name, _ in bucket]
    for (_, before), (_, after) in zip(bucket, back):
        assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)
