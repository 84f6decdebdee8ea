"""Runs inside vLLM's worker (`worker_extension_cls`): how new weights get into the engine.

vLLM mixes this class into its Worker. Where the model keeps its weights in
their checkpoint layout (the plain-weights loader on CPU), the worker can hand
the trainer its parameter tensors, or move them into a shared-memory file the
trainer maps, and the trainer writes each sync itself (`arctic_expose_weights`).
Otherwise every path ends in one load of checkpoint-format (Hugging Face named)
weights, which vLLM maps onto its fused layers: plain weights through the
model's `load_weights`, a copy into the tensors the forward pass reads; any
other through the worker's `reload_weights`, vLLM's layer-by-layer reload that
redoes the post-load processing (repacking, quantization). Either takes one
iterator over all weights, so the bucketed paths (broadcast, or shared-memory
slots between processes) stream their buckets through one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import weakref
from datetime import timedelta

import sys

import torch

from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.patches import InstancePatch
from arctic_rl_core.samplers.base import (process_random_state, random_state_bytes, random_state_tensors,
                                          set_process_random_state)
from arctic_rl_core.samplers.vllm_plain_weights import MARKER as PLAIN_WEIGHTS
from arctic_rl_core.samplers.vllm_plain_weights import repack
from arctic_rl_core.samplers.vllm_routed_experts import RoutedExpertsExtension


def _broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reusable(holder, attr: str, nbytes: int) -> torch.Tensor:
    """A byte buffer kept on `holder` between syncs: fresh memory is what costs most on our VMs."""
    buf = getattr(holder, attr, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=_device())
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


def _prepack_on_updates(method) -> int:
    setup = method._setup_kernel

    def setup_kernel(layer, w13, w2):
        update = method.moe_kernel is not None
        setup(layer, w13, w2)
        if update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = setup_kernel
    return 1


PREPACK_EXPERTS_ON_UPDATES = InstancePatch(
    "a weight update also runs the experts' own post-load step (fused_experts.process_weights_after_loading)",
    _prepack_on_updates,
    "vLLM 0.32 runs it on the first load only: on CPU that step prepacks the experts into the grouped GEMM's layout, "
    "so after a reload the kernel read the new weights unpacked (a tiny Qwen3-MoE's MoE block off by more than its "
    "output's size)", __name__)


def prepack_experts_on_weight_updates(model: torch.nn.Module) -> int:
    """`PREPACK_EXPERTS_ON_UPDATES` on every unquantized mixture-of-experts layer of `model` (vLLM's reload path)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    methods = {id(m.quant_method): m.quant_method for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), UnquantizedFusedMoEMethod)}
    for method in methods.values():
        PREPACK_EXPERTS_ON_UPDATES.apply(method)
    return len(methods)


class WeightSyncExtension:
    def arctic_forest_cascade_served(self) -> dict:
        """Decoding steps this worker ran with forest cascade attention (zorro.inference), and without."""
        module = sys.modules.get("arctic_rl_core.samplers.vllm_forest_attention")
        return {} if module is None else dict(module.SERVED)

    def arctic_compute_threads(self) -> int:
        """The threads this worker's CPU model computes on (`vllm_core_executor`)."""
        return torch.get_num_threads()

    def arctic_load_weights(self, weights) -> int:
        """In-process engine: `weights` yields the trainer's tensors themselves (shared memory, no copy in transit)."""
        return self._arctic_reload(weights)

    def arctic_load_file(self, path: str) -> int:
        """File fallback: a safetensors file written by the trainer (never a pickle)."""
        from safetensors.torch import load_file

        return self._arctic_reload(load_file(path, device=str(_device())).items())

    def arctic_expose_weights(self, shared: bool) -> dict | None:
        """Where vLLM's weights live, for a trainer that writes them itself: the tensors (same process), or
        a shared-memory file they are moved into (another process on this host). Only weights kept in their
        checkpoint layout can be written from outside; otherwise None."""
        if not self._arctic_in_place() or self.vllm_config.model_config.quantization is not None:
            return None
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())  # a tied parameter appears once
        packed = {fused: list(shards) for fused, shards in getattr(model, "packed_modules_mapping", {}).items()}
        if not shared:
            return {"tensors": {name: p.data for name, p in params.items()}, "packed": packed}
        offsets, total = {}, 0
        for name, p in params.items():
            offsets[name] = total
            total += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned
        slot = SharedSlot(total)

        def into_slot(model) -> int:
            for name, p in params.items():
                view = tensor_at(slot.buffer, offsets[name], p.dtype, p.shape)
                view.copy_(p.data)
                p.data = view
            return len(params)

        InstancePatch("parameters' storage moved into a shared-memory file", into_slot,
                      "the trainer process maps that file and writes each sync into it", __name__).apply(model)
        self._arctic_weights_slot = slot  # mapped for the worker's lifetime
        return {"path": slot.path, "packed": packed,
                "params": {name: [offsets[name], str(p.dtype).removeprefix("torch."), list(p.shape)]
                           for name, p in params.items()}}

    def arctic_repack(self) -> int:
        """After the trainer wrote the weights in place: rebuild the packs the forward pass multiplies with
        (`cpu_weight_layout: packed`; nothing for plain weights)."""
        return repack(self.model_runner.get_model())

    def arctic_join_sync_group(self, host: str, port: int, timeout_s: float, nccl: bool) -> bool:
        """Join the trainer's two-member process group (trainer rank 0, this worker rank 1)."""
        self._arctic_group, self._arctic_store = join_group(host, port, 1, timeout_s, is_master=False, nccl=nccl)
        return True

    def arctic_receive_buckets(self) -> int:
        """Load buckets as they arrive (broadcast, or through shared memory) until the trainer's end marker."""
        # vLLM's layer-by-layer reload holds each layer's tensors until the layer is complete.
        buckets = receive_buckets(self._arctic_group, self, copy=not self._arctic_in_place())
        try:
            return self._arctic_reload(buckets)
        finally:
            buckets.close()  # after a failed load: drain the trainer's remaining buckets

    def _arctic_in_place(self) -> bool:
        return getattr(self.model_runner.get_model(), PLAIN_WEIGHTS, False)

    def _arctic_reload(self, weights) -> int:
        if not getattr(self, "_arctic_moe_prepack", False):
            prepack_experts_on_weight_updates(self.model_runner.get_model())
            self._arctic_moe_prepack = True
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        if self._arctic_in_place():
            self.model_runner.get_model().load_weights(counted())
            self.arctic_repack()
        else:
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count


class RandomStateExtension:
    """The worker's generators, which vLLM's unseeded sampling draws from, for a checkpoint to keep."""

    def arctic_random_state(self) -> dict[str, bytes]:
        return random_state_bytes(process_random_state())

    def arctic_set_random_state(self, state: dict[str, bytes]) -> None:
        set_process_random_state(random_state_tensors(state))


class WorkerExtension(WeightSyncExtension, RoutedExpertsExtension, RandomStateExtension):
    """What vLLM's Worker gets from Arctic RL (`worker_extension_cls`): the weight sync's methods, R3's record, and
    the sampling generators' state."""
