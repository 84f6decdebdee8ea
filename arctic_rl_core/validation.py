"""Parsing untrusted input into the API's pydantic types, with errors that name the field."""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic

from arctic_rl_core.errors import InvalidRequest, field_path

Model = TypeVar("Model", bound=pydantic.BaseModel)


def parse(model: type[Model], value: Any, field: str) -> Model:
    """Validate `value` as `model`; the first problem becomes an `InvalidRequest` naming its field."""
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        raise InvalidRequest(field_path(field, tuple(first["loc"])), first["msg"]) from None
