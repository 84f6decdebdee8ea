"""Runs inside vLLM's worker (`worker_extension_cls`): how new weights get into the engine.

vLLM mixes this class into its Worker. Every path ends in the worker's
`reload_weights`, vLLM's in-place reload of checkpoint-format (Hugging Face
named) weights, which maps them onto fused layers and redoes the post-load
processing. A reload takes one iterator over all weights, so the broadcast
path streams its buckets through one.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
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


class BucketSender:
    """Trainer side: packs tensors into a flat bucket as they arrive and broadcasts each full bucket
    as header [layout bytes, data bytes], JSON layout, data; `close` sends the end marker.
    The bucket memory belongs to `owner` and is reused by the next sync."""

    def __init__(self, group, bucket_bytes: int, owner):
        self.group = group
        self.owner = owner
        self.capacity = bucket_bytes
        self.flat = _reusable(owner, "_arctic_send_buffer", bucket_bytes)
        self.layout: list = []
        self.used = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.used + nbytes > self.capacity:
            self.flush()
        if nbytes > self.capacity:  # a tensor larger than a bucket travels alone
            self.capacity = nbytes
            self.flat = _reusable(self.owner, "_arctic_send_buffer", nbytes)
        self.flat[self.used : self.used + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self.layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.used))
        self.used += nbytes

    def flush(self) -> None:
        if not self.layout:
            return
        meta = torch.frombuffer(bytearray(json.dumps(self.layout).encode()), dtype=torch.uint8)
        _broadcast(self.group, torch.tensor([meta.numel(), self.used], dtype=torch.int64))
        _broadcast(self.group, meta)
        _broadcast(self.group, self.flat[: self.used])
        self.layout, self.used = [], 0

    def close(self) -> None:
        self.flush()
        _broadcast(self.group, torch.zeros(2, dtype=torch.int64))


def join_group(host: str, port: int, rank: int, timeout_s: float, is_master: bool):
    store = torch.distributed.TCPStore(host, port, world_size=2, is_master=is_master,
                                       timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    if torch.cuda.is_available():
        return torch.distributed.ProcessGroupNCCL(store, rank, 2), store
    return torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s)), store


class WeightSyncExtension:
    def arctic_load_weights(self, weights) -> int:
        """In-process engine: `weights` yields the trainer's tensors themselves (shared memory, no copy in transit)."""
        return self._arctic_reload(weights)

    def arctic_load_file(self, path: str) -> int:
        """File fallback: a safetensors file written by the trainer (never a pickle)."""
        from safetensors.torch import load_file

        return self._arctic_reload(load_file(path, device=str(_device())).items())

    def arctic_join_sync_group(self, host: str, port: int, timeout_s: float) -> bool:
        """Join the trainer's two-member process group (trainer rank 0, this worker rank 1)."""
        self._arctic_group, self._arctic_store = join_group(host, port, 1, timeout_s, is_master=False)
        return True

    def arctic_receive_broadcast(self) -> int:
        """Receive buckets by broadcast until the trainer's end marker, loading them as they come."""
        group = self._arctic_group

        def stream():
            while True:
                head = torch.empty(2, dtype=torch.int64)
                _broadcast(group, head)
                meta_bytes, nbytes = head.tolist()
                if meta_bytes == 0:
                    return
                meta = torch.empty(meta_bytes, dtype=torch.uint8)
                _broadcast(group, meta)
                flat = _reusable(self, "_arctic_receive_buffer", nbytes)
                _broadcast(group, flat)
                for name, dtype, shape, offset in json.loads(meta.numpy().tobytes()):
                    dt = getattr(torch, dtype)
                    size = int(torch.Size(shape).numel()) * dt.itemsize
                    yield name, flat[offset : offset + size].view(dt).view(shape)

        return self._arctic_reload(stream())

    def _arctic_reload(self, weights) -> int:
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        return count
