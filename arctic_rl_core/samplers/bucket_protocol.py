"""The bucketed weight-sync protocol between a trainer and a sampler: buckets of tensors broadcast in a process
group of its own, or packed into shared-memory slots that the other side maps on one host. No engine is imported
here: vLLM's worker (`vllm_worker`) and the Ray replicas of any sampler (`replica`) receive by it alike."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import weakref
from datetime import timedelta

import torch

from arctic_rl_core.errors import ArcticRLError


def _broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def sync_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reusable(holder, attr: str, nbytes: int) -> torch.Tensor:
    """A byte buffer kept on `holder` between syncs: fresh memory is what costs most on our VMs."""
    buf = getattr(holder, attr, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=sync_device())
        setattr(holder, attr, buf)
    return buf[:nbytes]


def _shared_memory_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedSlot:
    """A byte buffer in a shared-memory file that another process on this host maps by its path.
    The file is unlinked as soon as the other side has mapped it (and at exit); only a process killed
    in between leaves it behind."""

    def __init__(self, nbytes: int):
        directory = _shared_memory_dir()
        fd, self.path = tempfile.mkstemp(prefix="arctic-rl-sync-", dir=directory)
        try:
            # Reserve the pages now: a tmpfs that runs out later kills the writer with SIGBUS.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            unlink_shared(self.path)
            raise ArcticRLError(f"sampler.sync: no room for {nbytes / 2**20:.0f} MB of shared memory in {directory} "
                                f"({err.strerror}); enlarge it (e.g. docker --shm-size) or use broadcast") from err
        finally:
            os.close(fd)
        self.buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        self._unlink = weakref.finalize(self, unlink_shared, self.path)  # also at exit, if never mapped

    def unlink(self) -> None:
        self._unlink()


def release_shared_slots(owner) -> None:
    """Unlink the shared-memory slots a `BucketSender` keeps on `owner` for its next sync: the one packed last may
    never have been mapped, and a process that a signal ends runs no finalizer (the server closes its job first)."""
    for slot in owner.__dict__.pop("_arctic_shared_slots", ()):
        if slot is not None:
            slot.unlink()


def tensor_at(flat: torch.Tensor, offset: int, dtype: torch.dtype | str, shape) -> torch.Tensor:
    """The tensor of `dtype` (or its name) and `shape` stored in the byte buffer `flat` from `offset`."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return flat[offset : offset + int(torch.Size(shape).numel()) * dt.itemsize].view(dt).view(shape)


def unlink_shared(path: str) -> None:
    """Either side may unlink a shared file first."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def map_shared(path: str) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)


class BucketSender:
    """Trainer side of a bucketed sync: packs tensors into a flat bucket as they arrive and sends each
    full bucket as a header [layout bytes, data bytes], then the JSON layout (names, dtypes, shapes,
    offsets, and where the data is), then the data; `close` sends the end marker.

    Over the wire (`shared_memory=False`) the data is broadcast from a buffer that the next sync reuses.
    On one host (`shared_memory=True`) the bucket is packed straight into one of two shared-memory
    slots the worker maps and only the header and layout are broadcast; the worker acknowledges each
    bucket once loaded, so the trainer packs one slot while the worker loads the other.
    The buffers and slots belong to `owner` and are reused by the next sync."""

    def __init__(self, group, bucket_bytes: int, owner, shared_memory: bool = False):
        self.group = group
        self.owner = owner
        self.capacity = bucket_bytes
        self.shared_memory = shared_memory
        self.layout: list = []
        self.used = 0
        self.turn = 0  # which of the two slots is packed next
        self.awaiting_ack: SharedSlot | None = None
        self.flat = self._buffer(bucket_bytes)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if not self.shared_memory:
            return _reusable(self.owner, "_arctic_send_buffer", nbytes)
        slots = self.owner.__dict__.setdefault("_arctic_shared_slots", [None, None])
        if slots[self.turn] is None or slots[self.turn].buffer.numel() < nbytes:
            if slots[self.turn] is not None:
                slots[self.turn].unlink()
            slots[self.turn] = SharedSlot(nbytes)
        self.slot = slots[self.turn]
        return self.slot.buffer[:nbytes]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.used + nbytes > self.capacity:
            self.flush()
        if nbytes > self.capacity:  # a tensor larger than a bucket travels alone
            self.capacity = nbytes
            self.flat = self._buffer(nbytes)
        self.flat[self.used : self.used + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self.layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.used))
        self.used += nbytes

    def flush(self) -> None:
        if not self.layout:
            return
        self._receive_ack()
        where = self.slot.path if self.shared_memory else None
        live = [slot.path for slot in self.owner.__dict__.get("_arctic_shared_slots", ()) if slot is not None]
        meta = torch.frombuffer(bytearray(json.dumps({"layout": self.layout, "slot": where, "live": live}).encode()),
                                dtype=torch.uint8)
        _broadcast(self.group, torch.tensor([meta.numel(), self.used], dtype=torch.int64))
        _broadcast(self.group, meta)
        if self.shared_memory:
            self.awaiting_ack = self.slot
            self.turn = 1 - self.turn
            self.flat = self._buffer(self.capacity)  # packed while the worker loads the other slot
        else:
            _broadcast(self.group, self.flat[: self.used])
        self.layout, self.used = [], 0

    def _receive_ack(self) -> None:
        slot, self.awaiting_ack = self.awaiting_ack, None  # waited for once, even if the wait fails
        if slot is not None:
            _broadcast(self.group, torch.zeros(1, dtype=torch.int64), root=1)
            slot.unlink()  # the worker has it mapped now

    def close(self) -> None:
        self.flush()
        self._receive_ack()
        _broadcast(self.group, torch.zeros(2, dtype=torch.int64))


def _receive_bucket(group, holder) -> tuple[dict, torch.Tensor] | None:
    """The next bucket's layout and bytes; None at the end marker."""
    head = torch.empty(2, dtype=torch.int64)
    _broadcast(group, head)
    meta_bytes, nbytes = head.tolist()
    if meta_bytes == 0:
        return None
    meta = torch.empty(meta_bytes, dtype=torch.uint8)
    _broadcast(group, meta)
    bucket = json.loads(meta.numpy().tobytes())
    if bucket["slot"] is None:
        flat = _reusable(holder, "_arctic_receive_buffer", nbytes)
        _broadcast(group, flat)
        return bucket, flat
    mapped = {path: t for path, t in holder.__dict__.get("_arctic_mapped_slots", {}).items() if path in bucket["live"]}
    if bucket["slot"] not in mapped:
        mapped[bucket["slot"]] = map_shared(bucket["slot"])
    holder._arctic_mapped_slots = mapped
    return bucket, mapped[bucket["slot"]]


def _acknowledge(group, bucket: dict) -> None:
    if bucket["slot"] is not None:  # the trainer may now reuse the slot
        _broadcast(group, torch.ones(1, dtype=torch.int64), root=1)


def receive_buckets(group, holder, copy: bool):
    """Worker side of `BucketSender`: yields (name, tensor) until the end marker. A tensor is a view of
    the bucket, valid until the next bucket arrives, unless `copy` (for loaders that hold on to tensors).
    Closed early (the loader failed), it still takes the trainer's remaining buckets, so the trainer's
    side of the protocol ends and the next sync starts in step."""
    pending = None  # a bucket yielded from and not yet acknowledged
    try:
        while (received := _receive_bucket(group, holder)) is not None:
            pending, flat = received
            for name, dtype, shape, offset in pending["layout"]:
                tensor = tensor_at(flat, offset, dtype, shape)
                yield name, tensor.clone() if copy else tensor
            _acknowledge(group, pending)
            pending = None
    finally:
        if pending is not None:
            _acknowledge(group, pending)
            while (received := _receive_bucket(group, holder)) is not None:
                _acknowledge(group, received[0])


def join_group(host: str, port: int, rank: int, timeout_s: float, is_master: bool, nccl: bool, world_size: int = 2):
    """A process group of its own (not torch.distributed's default), rendezvous at the master's TCPStore."""
    store = torch.distributed.TCPStore(host, port, world_size=world_size, is_master=is_master,
                                       timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    if nccl:
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size), store
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s)), store
