"""Reading question files (a JSON list, or JSON Lines) with errors that name the file and record."""

from __future__ import annotations

import json
import os

from arctic_rl_core.errors import InvalidRequest


def read_json_records(path: str | None, field: str, required: tuple[str, ...], format_name: str) -> list[dict]:
    """The records of a JSON list or JSON Lines file; each must be an object holding the `required` keys."""
    if not path:
        raise InvalidRequest(field, "is required")
    if not os.path.isfile(path):
        raise InvalidRequest(field, f"file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):  # JSON Lines of one record
        data = [data]
    if data is None:  # JSON Lines (MuSiQue ships .jsonl)
        data = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise InvalidRequest(field, f"{path} is neither JSON nor JSON Lines (line {line_no}: {err.msg})") from None
    if not isinstance(data, list):
        raise InvalidRequest(field, f"{path} must hold a list of {format_name} records, found a {type(data).__name__}")
    if not data:
        raise InvalidRequest(field, f"{path} holds no examples")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise InvalidRequest(f"{field}[{i}]", f"must be an object ({format_name} format), found a {type(record).__name__}")
        missing = [k for k in required if k not in record]
        if missing:
            raise InvalidRequest(f"{field}[{i}].{missing[0]}",
                                 f"missing; {format_name} records hold {', '.join(required)} ({path})")
    return data
