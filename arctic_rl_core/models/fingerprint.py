"""A fingerprint of a checkpoint's weights, cheap enough for every start-up.

Two checkpoints of the same family and size (a base and an instruct model) have the same config and the
same tensor shapes; their bytes differ. The fingerprint hashes each safetensors file's name, size and
header (names, dtypes, shapes) and three 1 MiB samples of its tensor bytes (start, middle, end): a few
MiB read per file, whatever the model's size. It tells different weights apart with near certainty; it
is not a cryptographic digest of the whole file.
"""

from __future__ import annotations

import hashlib
import os
import struct

SAMPLE_BYTES = 1 << 20


def checkpoint_fingerprint(model_path: str) -> str | None:
    """The fingerprint of the safetensors weights in folder `model_path`; None if it holds none."""
    if not os.path.isdir(model_path):
        return None
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for name in files:
        with open(os.path.join(model_path, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f"{name}:{size}:".encode())
            digest.update(f.read(header_len))
            start = 8 + header_len
            for offset in sorted({start, start + max(0, (size - start) // 2 - SAMPLE_BYTES // 2),
                                  max(start, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
