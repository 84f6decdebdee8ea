"""The wire format: round trips, and a property-based fuzz of the decoder (clean errors only, never pickle)."""

import json
import pickle
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load, save

from arctic_rl_core import wire
from arctic_rl_core.wire import WireError, decode, encode


@pytest.fixture(autouse=True)
def no_pickle(monkeypatch):
    """Any path that reaches pickle fails the test loudly (not as a WireError)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the wire decoder reached pickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", forbidden)


def valid_message():
    return {
        "sequences": [
            {"prompt_ids": list(range(3, 40)), "response_ids": list(range(9, 25)), "group_id": 3,
             "advantages": [0.25] * 16, "loss_mask": None},
            {"prompt_ids": [7, 8], "response_ids": list(range(100, 120)), "group_id": "g",
             "advantages": [-1.5] * 20, "loss_mask": [1.0] * 20},
        ],
        "loss": {"name": "grpo", "config": {"betas": [0.9, 0.999], "eps_clip": 0.2}, "post": []},
    }


def test_round_trip_keeps_structure_and_values():
    message = valid_message()
    assert decode(encode(message)) == message  # floats here are exact in float32
    assert decode(encode({"x": 0.1}))["x"] == 0.1  # scalars stay JSON numbers


def test_arrays_share_one_tensor_per_field():
    data = encode(valid_message())
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    assert {"sequences.*.prompt_ids", "sequences.*.response_ids", "sequences.*.advantages"} <= set(header)
    assert header["sequences.*.response_ids"]["shape"] == [36]


def test_interoperates_with_the_safetensors_library():
    body = encode({"x": np.arange(12, dtype=np.float64), "ids": list(range(30)), "p": [0.5] * 9})
    tensors = load(body)  # the library reads what we write
    assert tensors["x"].dtype == np.float64 and tensors["ids"].tolist() == list(range(30))
    theirs = save({"t": np.arange(9, dtype=np.int32)}, metadata={"arctic_rl": '{"q": {"$t": "t", "o": 2, "n": 3}}', "version": "1"})
    assert decode(theirs) == {"q": [2, 3, 4]}  # and we read what it writes


def test_small_integer_arrays_keep_their_width_and_the_library_reads_them():
    routes = [np.arange(24, dtype=np.uint8) % 7, np.arange(16, dtype=np.uint8)]  # routing records: one byte an id
    wide = np.arange(300, 320, dtype=np.uint16)
    body = encode({"r": [{"ids": r} for r in routes], "w": wide, "s": np.arange(-8, 8, dtype=np.int16)})
    tensors = load(body)
    assert tensors["r.*.ids"].dtype == np.uint8 and tensors["r.*.ids"].size == 40
    assert tensors["w"].dtype == np.uint16 and tensors["s"].dtype == np.int16
    back = decode(body, arrays=True)
    assert [a.dtype for a in (back["r"][0]["ids"], back["w"], back["s"])] == [np.uint8, np.uint16, np.int16]
    assert back["r"][1]["ids"].tolist() == list(range(16)) and back["s"].tolist() == list(range(-8, 8))
    # Mixed with plain lists at the same path, the group widens as before.
    mixed = load(encode({"r": [{"ids": routes[0]}, {"ids": list(range(300, 310))}]}))
    assert mixed["r.*.ids"].dtype == np.int32


def test_streamed_parts_equal_the_whole_body():
    parts = wire.encode_parts({"x": np.arange(100, dtype=np.float32), "y": list(range(50))})
    assert b"".join(bytes(p) for p in parts) == parts.tobytes() and len(parts) == len(parts.tobytes())
    assert list(parts) and list(parts)  # iterable again (retries resend it)


def test_numpy_arrays_decode_as_zero_copy_views():
    data = bytearray(encode({"x": np.arange(1000, dtype=np.float64)}))
    view = decode(data, arrays=True)["x"]
    assert view.dtype == np.float64 and view[999] == 999.0 and not view.flags.owndata


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(width=32, allow_nan=False), st.text(max_size=8))
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=12), st.dictionaries(st.text(max_size=6), inner, max_size=6)),
    max_leaves=40,
)


@given(json_values)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_any_json_message_round_trips(message):
    assert decode(encode({"m": message})) == {"m": message}


@given(st.binary(max_size=512))
def test_random_bytes_give_only_wire_errors(data):
    try:
        decode(data)
    except WireError as err:
        assert err.field == "body" and err.message


@given(st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_mutated_messages_give_only_wire_errors(data):
    raw = bytearray(encode(valid_message()))
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "header_len"]))
        if kind == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del raw[data.draw(st.integers(0, len(raw))):]
        elif kind == "insert":
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif len(raw) >= 8:
            raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    try:
        decode(bytes(raw))
    except WireError:
        pass


@given(st.dictionaries(st.sampled_from(["$t", "o", "n", "x"]), st.one_of(st.integers(-5, 10**12), st.text(max_size=4), st.none()), min_size=1))
def test_hostile_references_give_only_wire_errors(ref):
    body = save({"t": np.arange(10, dtype=np.int32)}, metadata={"arctic_rl": json.dumps({"a": ref}), "version": "1"})
    try:
        decode(body)
    except WireError:
        pass


def test_deep_nesting_is_refused():
    body = save({}, metadata={"arctic_rl": "[" * 100 + "]" * 100, "version": "1"})
    with pytest.raises(WireError, match="deeper"):
        decode(body)
