"""The wire format: one safetensors file per message, never pickle.

A message is JSON-shaped data in which every flat numeric array (of at least
8 numbers; numpy arrays always) travels as a tensor: Python floats as float32,
the precision the engines compute in, integers as int32 when they fit; numpy
arrays of small integers (uint8, uint16, int16: routing records) keep their width. The safetensors header's `__metadata__` holds the JSON structure
(`"arctic_rl"`) and the format version; inside it, an array is the reference
`{"$t": name, "o": offset, "n": length}` to elements of the 1-D tensor
`name`. All arrays at the same field path (say every sequence's `prompt_ids`)
share one tensor, so the header stays small for large batches.

Encoding lays out the safetensors file itself so that a large body is sent as
its header plus views of the tensors' memory, never assembled into one more
copy; decoding parses the header itself (the library reads metadata only from
files) and maps tensors zero-copy onto the received buffer, checking every
size, offset, dtype and reference first. The tests check both directions
against the safetensors library. Any malformed input raises `WireError`;
nothing else escapes, and no code path can unpickle.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from arctic_rl_core.errors import InvalidRequest

MEDIA_TYPE = "application/x-arctic-rl-safetensors"
VERSION = "1"
_DTYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
           "U8": np.dtype("u1"), "U16": np.dtype("<u2"), "I16": np.dtype("<i2")}
_COMPACT = {np.dtype("u1"), np.dtype("<u2"), np.dtype("<i2")}
"""Integer widths a numpy array keeps on the wire (a group of them all the same width)."""
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER_BYTES = 64 * 2**20
_MAX_DEPTH = 64
_SEND_CHUNK = 1 << 20
_MIN_TENSOR_ELEMENTS = 8  # shorter lists (config values, tiny responses) stay exact JSON numbers


class WireError(InvalidRequest):
    """The body is not a valid Arctic RL message."""

    def __init__(self, message: str, field: str = "body"):
        super().__init__(field, message)


def _group_key(path: tuple) -> str:
    return ".".join("*" if isinstance(p, int) else str(p) for p in path) or "root"


@dataclass
class Encoded:
    """A message as a safetensors file in parts: the header, then each tensor's memory."""

    header: bytes
    buffers: list[memoryview]

    def __len__(self) -> int:
        return len(self.header) + sum(b.nbytes for b in self.buffers)

    def __iter__(self) -> Iterator[bytes | memoryview]:
        """The body in order, without copying tensor data (iterable again for retries).

        Slices of 1 MiB: HTTP writers copy each piece they are given, and small copies land in
        memory the allocator reuses, where one copy of a whole large tensor would fault in fresh pages.
        """
        yield self.header
        for buffer in self.buffers:
            for start in range(0, buffer.nbytes, _SEND_CHUNK):
                yield buffer[start : start + _SEND_CHUNK]

    async def __aiter__(self):
        """The same parts for asyncio senders."""
        for part in self:
            yield part

    def tobytes(self) -> bytes:
        return b"".join(self)


def encode(message: Any) -> bytes:
    """JSON-shaped data (dicts, lists, numbers, strings, None, numpy arrays) -> safetensors bytes."""
    return encode_parts(message).tobytes()


def encode_parts(message: Any) -> Encoded:
    """Like `encode`, but leaves tensor data where it is, for streaming a large body."""
    groups: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}

    def as_array(value) -> np.ndarray | None:
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "iuf":
                return None
            # numpy arrays keep their precision (f16 widens to f32, unsigned to i64)
            if value.dtype.kind == "f":
                return value.reshape(-1).astype(np.float64 if value.dtype.itemsize == 8 else np.float32, copy=False)
            if value.dtype.newbyteorder("<") in _COMPACT:
                return value.reshape(-1)
            return value.reshape(-1).astype(np.int64, copy=False)
        if len(value) < _MIN_TENSOR_ELEMENTS or not set(map(type, value)) <= {int, float}:
            return None  # bools, None, strings or nested values: stays JSON
        arr = np.asarray(value)
        if arr.dtype.kind not in "if":  # integers beyond int64 come out as uint64 or object
            return None
        # Python floats travel as float32: the engines compute in at most fp32, as in process.
        return arr.astype(np.float32) if arr.dtype.kind == "f" else arr

    def walk(value, path):
        if isinstance(value, dict):
            # A user key starting with "$" gets one more "$", so no user dict reads as a reference.
            return {(f"${k}" if k.startswith("$") else k): walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple, np.ndarray)):
            arr = as_array(value)
            if arr is None:
                return [walk(v, path + (i,)) for i, v in enumerate(value)]
            key = _group_key(path)
            offset = sizes.get(key, 0)
            groups.setdefault(key, []).append(arr)
            sizes[key] = offset + arr.size
            return {"$t": key, "o": offset, "n": int(arr.size)}
        if isinstance(value, np.generic):
            return value.item()
        return value

    structure = walk(message, ())
    tensors = {}
    for key, arrays in groups.items():
        flat = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        if flat.dtype.kind in "iu" and flat.dtype.newbyteorder("<") not in _COMPACT:
            small = flat.size == 0 or (flat.min() >= -(2**31) and flat.max() < 2**31)
            flat = flat.astype(np.int32 if small else np.int64, copy=False)
        tensors[key] = np.ascontiguousarray(flat)
    return _layout(tensors, {"arctic_rl": json.dumps(structure), "version": VERSION})


def _layout(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> Encoded:
    # Widest dtypes first keeps every tensor aligned to its element size for zero-copy reads.
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        arr = tensors[name]
        header[name] = {"dtype": _DTYPE_NAMES[arr.dtype.newbyteorder("<")], "shape": [arr.size],
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    buffers = [memoryview(tensors[name].astype(tensors[name].dtype.newbyteorder("<"), copy=False)).cast("B") for name in order]
    return Encoded(struct.pack("<Q", len(text)) + text, buffers)


def _header(body: memoryview) -> tuple[dict, int]:
    if len(body) < 8:
        raise WireError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", body[:8])
    if size > min(len(body) - 8, _MAX_HEADER_BYTES):
        raise WireError(f"safetensors header claims {size} bytes; the body has {len(body) - 8}")
    try:
        header = json.loads(bytes(body[8 : 8 + size]))
    except (ValueError, RecursionError) as err:
        raise WireError(f"safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise WireError("safetensors header must be a JSON object")
    return header, 8 + size


def _tensors(header: dict, body: memoryview, data_start: int) -> dict[str, np.ndarray]:
    data_len = len(body) - data_start
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict):
            raise WireError(f"tensor {name!r}: entry must be an object")
        dtype = _DTYPES.get(spec.get("dtype"))
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if dtype is None:
            raise WireError(f"tensor {name!r}: dtype {spec.get('dtype')!r} is not one of {', '.join(_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] >= 0):
            raise WireError(f"tensor {name!r}: shape must be [n] with n >= 0, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise WireError(f"tensor {name!r}: data_offsets must be [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len or end - begin != shape[0] * dtype.itemsize:
            raise WireError(f"tensor {name!r}: data_offsets {offsets} do not fit shape {shape} in {data_len} data bytes")
        out[name] = np.frombuffer(body, dtype=dtype, count=shape[0], offset=data_start + begin)
    return out


def decode(body: bytes | bytearray | memoryview, *, arrays: bool = False) -> Any:
    """safetensors bytes -> the JSON-shaped message. Arrays become lists, or numpy views if `arrays`."""
    view = memoryview(body).cast("B")
    header, data_start = _header(view)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get("arctic_rl"), str):
        raise WireError("safetensors metadata lacks the 'arctic_rl' message structure")
    if meta.get("version") != VERSION:
        raise WireError(f"wire format version {meta.get('version')!r} is not supported (expected {VERSION})")
    tensors = _tensors(header, view, data_start)
    try:
        structure = json.loads(meta["arctic_rl"])
    except (ValueError, RecursionError) as err:
        raise WireError(f"message structure is not JSON: {err}") from None

    def resolve(value, depth):
        if depth > _MAX_DEPTH:
            raise WireError(f"message nests deeper than {_MAX_DEPTH} levels")
        if isinstance(value, dict):
            if "$t" in value:
                return reference(value)
            return {(k[1:] if k.startswith("$$") else k): resolve(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, depth + 1) for v in value]
        return value

    # Decoded arrays may not add up to more elements than the body carries: a small body whose
    # references all point at one large tensor would otherwise decode into gigabytes.
    budget = {name: t.size for name, t in tensors.items()}

    def reference(ref):
        name, offset, length = ref.get("$t"), ref.get("o"), ref.get("n")
        if set(ref) != {"$t", "o", "n"} or not isinstance(name, str):
            raise WireError(f"malformed array reference {str(ref)[:80]}")
        if name not in tensors:
            raise WireError(f"array reference to unknown tensor {name!r}")
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= tensors[name].size):
            raise WireError(f"array reference [{offset}, +{length}) is outside tensor {name!r} ({tensors[name].size})")
        budget[name] -= length
        if budget[name] < 0:
            raise WireError(f"array references to tensor {name!r} add up to more than its {tensors[name].size} elements")
        part = tensors[name][offset : offset + length]
        return part if arrays else part.tolist()

    return resolve(structure, 0)
