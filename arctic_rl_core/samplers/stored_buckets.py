"""Weight buckets in the form Ray's object store moves best: each tensor's bytes as a numpy array, beside its
dtype and shape (numpy has no bfloat16). Ray writes a numpy array into the store in one copy and maps it back
without one on the same node, where a torch tensor is pickled through bytes both ways: 148 MB took 0.6 s as
tensors and 0.02-0.1 s as arrays (docs/benchmarks.md, weight sync across Ray nodes)."""

from __future__ import annotations

import warnings
from typing import Iterable

import numpy as np
import torch

StoredBucket = list[tuple[str, str, tuple[int, ...], np.ndarray]]


def stored(bucket: Iterable[tuple[str, torch.Tensor]]) -> StoredBucket:
    """The bucket's tensors as arrays of their bytes (sharing the tensors' memory until Ray copies them)."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
             t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in bucket]


def loaded(bucket: StoredBucket) -> list[tuple[str, torch.Tensor]]:
    """The tensors again, on the arrays' memory: read-only where Ray maps it from its store, so only read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(name, _tensor(getattr(torch, dtype), shape, data)) for name, dtype, shape, data in bucket]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], data: np.ndarray) -> torch.Tensor:
    if data.size == 0:  # no bytes to reinterpret
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(shape)
