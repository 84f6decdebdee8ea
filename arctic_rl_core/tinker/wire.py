"""Tinker's protobuf messages (the SDK's own `tinker_public_pb2`) to and from Arctic RL's types.

A Tinker `Datum` is N input tokens x and N targets t with per-position inputs: position i scores t[i] after
x[0..i]. Where the targets are the inputs shifted by one (every text datum the SDK and the cookbook build), it is
the sequence x + [t[N-1]] with all N positions scored: an Arctic RL `Sequence` whose prompt is x[0] and whose
response is the rest, so that every position's log-prob is a response token's. Shared prefixes across datums are
found from the tokens (ZoRRo's forest), so nothing is lost by the one-token prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Completion, Sequence

MEDIA_TYPE = "application/x-protobuf"

_DTYPES = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8"), pb.DTYPE_INT32: np.dtype("<i4")}


@dataclass
class Batch:
    """One forward_backward request, decoded and checked."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    sequences: list[Sequence]
    inputs: list[dict[str, np.ndarray]]
    """Per datum, its loss_fn_inputs as arrays of N entries."""


def parse_request(body: bytes) -> pb.ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as err:  # protobuf raises DecodeError and, for some corruptions, others
        raise InvalidRequest("body", f"not a tinker_public.ForwardBackwardRequest: {err}") from None
    return message


def decode_batch(message: pb.ForwardBackwardRequest) -> Batch:
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    if not message.data:
        raise InvalidRequest("data", "must hold at least one datum")
    sequences, inputs = [], []
    for i, datum in enumerate(message.data):
        tokens = _tokens(datum, f"data[{i}].model_input")
        arrays = {key: _tensor(value, f"data[{i}].loss_fn_inputs.{key}") for key, value in datum.loss_fn_inputs.items()}
        for key, array in arrays.items():
            if array.ndim != 1 or len(array) != len(tokens):
                raise InvalidRequest(f"data[{i}].loss_fn_inputs.{key}",
                                     f"has shape {list(array.shape)}; this server takes ({len(tokens)},): one entry per "
                                     f"input token (multi-target (N, K) inputs are not supported)")
        targets = arrays.get("target_tokens")
        if targets is None:
            raise InvalidRequest(f"data[{i}].loss_fn_inputs.target_tokens", "is required")
        shifted = np.flatnonzero(targets[:-1] != tokens[1:])
        if shifted.size:
            k = int(shifted[0])
            raise InvalidRequest(f"data[{i}].loss_fn_inputs.target_tokens[{k}]",
                                 f"is {int(targets[k])} but the next input token is {int(tokens[k + 1])}: this server "
                                 f"scores a datum's own next tokens only")
        sequences.append(Sequence(prompt_ids=tokens[:1].tolist(), response_ids=[*tokens[1:].tolist(), int(targets[-1])]))
        inputs.append(arrays)
    return Batch(message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, sequences, inputs)


def _tokens(datum: pb.Datum, where: str) -> np.ndarray:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequest(f"{where}.chunks[{j}]", f"is a {kind} chunk: this server trains on text tokens only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")
    if not tokens.size:
        raise InvalidRequest(where, "holds no tokens")
    return tokens.astype(np.int64)


def _tensor(tensor: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequest(f"{where}.dtype", f"{pb.DType.Name(tensor.dtype)} is not float32, int64 or int32")
    if tensor.WhichOneof("encoding") != "dense":
        raise InvalidRequest(where, "sparse tensors (multi-target inputs) are not supported")
    if len(tensor.dense) % dtype.itemsize:
        raise InvalidRequest(where, f"holds {len(tensor.dense)} bytes, not a whole number of {dtype} values")
    values = np.frombuffer(tensor.dense, dtype=dtype)
    shape = list(tensor.shape) or [values.size]
    if int(np.prod(shape)) != values.size:
        raise InvalidRequest(f"{where}.shape", f"{shape} does not hold its {values.size} values")
    values = values.reshape(shape)
    if dtype.kind == "f" and not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values.ravel()))[0])
        raise InvalidRequest(f"{where}[{bad}]", "must be finite")
    return values


def forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """Per datum its N log-probs, in one batched record (the layout the SDK decodes)."""
    rows = [np.asarray(row, dtype="<f4") for row in logprobs]
    offsets = np.concatenate([[0], np.cumsum([row.nbytes for row in rows])]).astype("<i8")
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(rows), fields={
        "logprobs": pb.BatchedTensor(data=b"".join(row.tobytes() for row in rows), offsets=offsets.tobytes(),
                                     dtype=pb.DTYPE_FLOAT32)})
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


def sample_response(completions: list[Completion], prompt_logprobs: bool, topk_prompt: int, topk_sampled: int) -> bytes:
    """Sampled sequences with their log-probs (and their k most likely tokens with `topk_sampled`). With
    `prompt_logprobs` (`topk_prompt`), the prompt's own log-probs (k most likely) from the first completion's
    scoring, the first token's NaN (empty)."""
    message = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=pb.STOP_REASON_STOP if c.finish_reason == "stop" else pb.STOP_REASON_LENGTH,
                           tokens=np.asarray(c.token_ids, dtype="<i4").tobytes(),
                           logprobs=np.asarray(c.logprobs, dtype="<f4").tobytes(),
                           topk_sampled_logprobs=_topk(c.top_logprobs, topk_sampled) if topk_sampled else None)
        for c in completions])
    scored = completions[0].prompt_logprobs or []
    if prompt_logprobs:
        message.prompt_logprobs = np.asarray([np.nan, *(row[0][1] for row in scored)], dtype="<f4").tobytes()
    if topk_prompt:
        message.topk_prompt_logprobs.CopyFrom(_topk([[]] + [row[1:] for row in scored], topk_prompt))
    return message.SerializeToString()


# Tinker's empty cell of a top-k matrix.
_MASK_ID, _MASK_LOGPROB = 0, -99999.0


def _topk(rows: list[list[tuple[int, float]]], k: int) -> pb.TopkLogprobs:
    """Rows of (token id, log-prob) pairs as Tinker's (length, k) matrices, short rows filled with the mask."""
    ids = np.full((len(rows), k), _MASK_ID, dtype="<i4")
    logprobs = np.full((len(rows), k), _MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))
