"""Parsing untrusted input into the API's pydantic types, with errors that name the field.

Every number in a request must be one the engines can hold: floats finite, integers
within int64. A NaN loss coefficient or a seed of 2**70 is refused here, naming its
field, before it can reach a tensor (where it would answer NaN or fail with a 500).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np
import pydantic

from arctic_rl_core.errors import InvalidRequest, field_path

Model = TypeVar("Model", bound=pydantic.BaseModel)

INT64_MAX = 2**63 - 1


def _bad_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, int):
        return not -INT64_MAX <= value <= INT64_MAX
    return False


def check_numbers(value: Any, field: str) -> None:
    """Raise `InvalidRequest` naming the first non-finite float or out-of-range integer in `value`."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_numbers(item, field_path(field, (key,)) if isinstance(key, str) else field)
    elif isinstance(value, np.ndarray):
        _check_array(value, field)
    elif isinstance(value, (list, tuple)):
        kinds = set(map(type, value))
        if kinds <= {int}:  # token ids: range-checked at C speed
            if value and not -INT64_MAX <= min(value) <= max(value) <= INT64_MAX:
                i = next(i for i, v in enumerate(value) if _bad_number(v))
                raise InvalidRequest(field_path(field, (i,)), f"{value[i]} is outside the 64-bit integer range")
            return
        if kinds <= {int, float}:
            try:
                if math.isfinite(math.fsum(value)):
                    return  # an exact finite sum has no NaN, infinity or huge integer in it
            except OverflowError:
                pass
        for i, item in enumerate(value):
            check_numbers(item, field_path(field, (i,)))
    elif _bad_number(value):
        what = "must be a finite number" if isinstance(value, float) else "is outside the 64-bit integer range"
        raise InvalidRequest(field or "body", f"{value} {what}")


def _check_array(value: np.ndarray, field: str) -> None:
    """The same rules for a numpy array (as the wire format decodes them), vectorised."""
    flat = value.reshape(-1)
    if value.dtype.kind == "f":
        finite = np.isfinite(flat)
        if not finite.all():
            i = int(np.argmin(finite))
            raise InvalidRequest(field_path(field, (i,)), f"{flat[i]} must be a finite number")
    elif value.dtype.kind == "u" and flat.size and flat.max() > INT64_MAX:
        i = int(np.argmax(flat))
        raise InvalidRequest(field_path(field, (i,)), f"{flat[i]} is outside the 64-bit integer range")


def parse(model: type[Model], value: Any, field: str) -> Model:
    """Validate `value` as `model`; the first problem becomes an `InvalidRequest` naming its field."""
    if isinstance(value, model):
        return value
    check_numbers(value, field)
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        raise InvalidRequest(field_path(field, tuple(first["loc"])), first["msg"]) from None
