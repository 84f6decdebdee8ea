"""Tinker's tenants: who a request is, and which tenant's model the job's engine holds.

A tenant is an API key. With a keys file (`--tinker-keys`, `{"name": "key", ...}`) only its keys are taken and a
tenant is its name; without one, on loopback, whatever key the SDK sends names its tenant. A tenant sees only its
own sessions, models, sampling sessions, futures and checkpoints: anything else is answered as not found.

Several tenants' models (`--tinker-tenants N`) time-share the job's one engine. Each model's training state (its
trainable weights, optimizer state and unstepped gradients) is parked on disk while another model trains and
resumed before its next call (`Backend.park_policy` / `resume_policy`), so each trains exactly as it would alone.
A model starts from the job's policy as it was before it ever stepped (a LoRA job's untrained adapter), its adapter
shaped as the model asked (`models/lora_shape.py`); once the last model leaves, the job's policy is back as it was.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil

from fastapi import Request

from arctic_rl_core.errors import InvalidRequest, Unauthorized
from arctic_rl_core.models.lora_shape import AdapterShape

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
JOB = "job"
"""The residency of the job's own policy (no tenant's model)."""
UNTRAINED = ".untrained"
"""Where the job's policy is kept as it was before it ever stepped."""


def read_keys(path: str) -> dict[str, str]:
    """A keys file: a JSON object of tenant name -> API key (the SDK wants keys that start with `tml-`)."""
    try:
        with open(path) as f:
            keys = json.load(f)
    except (OSError, ValueError) as err:
        raise InvalidRequest("tinker_keys", f"{path}: {err}") from None
    if not isinstance(keys, dict) or not keys:
        raise InvalidRequest("tinker_keys", f"{path}: must be a JSON object of tenant name -> API key")
    for name, key in keys.items():
        if not _NAME.match(name) or name == JOB or name.startswith("."):
            raise InvalidRequest(f"tinker_keys.{name}", f"a tenant name is 1-64 of A-Z a-z 0-9 . _ -, not starting "
                                 f"with '.' (nor {JOB!r})")
        if not isinstance(key, str) or len(key) < 16:
            raise InvalidRequest(f"tinker_keys.{name}", "an API key is a string of at least 16 characters")
    if len(set(keys.values())) != len(keys):
        raise InvalidRequest("tinker_keys", f"{path}: two tenants share a key")
    return keys


def request_key(request: Request) -> str:
    key = request.headers.get("x-api-key")
    if key is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token if scheme.lower() == "bearer" else None
    return key or ""


def tenant_of(request: Request, keys: dict[str, str] | None) -> str:
    """The tenant a request speaks for: its key's name in the keys file, or (no file) a digest of its key."""
    key = request_key(request)
    if keys is None:
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    found = None
    for name, known in keys.items():  # every key compared, in constant time each
        if hmac.compare_digest(key.encode(), known.encode()):
            found = name
    if found is None:
        raise Unauthorized("x-api-key", "this API key is not one of the server's Tinker keys")
    return found


class Residency:
    """Which model's training state the engine holds. Its methods run on the job's ordered worker only."""

    def __init__(self, root: str):
        self.root = root
        self.resident: str | None = JOB
        """A model id, JOB, or None (the engine holds the state of a model that left)."""
        self.parked: dict[str, list] = {}
        """model id (or JOB) -> the fwd_bwd calls of its unstepped gradients; its state is in `directory(id)`."""
        self.untrained: bool | None = None
        """Whether `directory(UNTRAINED)` holds the job's policy as it was before it ever stepped, which every model
        starts from (decided when the first model enters: a job that trained before has none)."""

    def directory(self, model_id: str) -> str:
        return os.path.join(self.root, hashlib.sha256(model_id.encode()).hexdigest()[:24])

    def can_start(self, api, shape: AdapterShape | None) -> bool:
        """Whether a new model of adapter `shape` can start here: a shape other than the job's adapter needs the
        untrained adapter (`models/lora_shape.py`)."""
        return shape is None or bool(self.untrained) or self.untrained is None and api.policy_untrained

    def enter(self, api, model_id: str, shape: AdapterShape | None = None) -> None:
        """The engine holds `model_id`'s training state, its adapter shaped as `shape` (a new model's state is the
        job's untrained policy, or where there is none the job's policy as it is, without gradients)."""
        if self.resident == model_id:
            return
        new = model_id != JOB and model_id not in self.parked
        if new and not self.can_start(api, shape):
            raise InvalidRequest("lora_config", "a model of another rank or other modules than the job's adapter "
                                 "starts from an untrained adapter, and this job's policy trained before its first "
                                 "Tinker model: none is kept")
        if self.resident is not None:
            keep = self.resident == JOB and self.untrained is None
            untrained = keep and api.policy_untrained
            self.parked[self.resident] = api.park_policy(self.directory(self.resident))
            if keep:
                if untrained:
                    shutil.copytree(self.directory(JOB), self.directory(UNTRAINED), dirs_exist_ok=True)
                self.untrained = untrained
            self.resident = None  # until the next state is whole in the engine: a failed resume leaves no owner
        if model_id in self.parked:
            api.resume_policy(self.directory(model_id), self.parked.pop(model_id), shape)
        else:
            api.resume_policy(self.directory(UNTRAINED if self.untrained else JOB), [], shape)
        self.resident = model_id

    def leave(self, api, model_id: str, last: bool) -> None:
        """`model_id` is gone, with what it never saved; after the `last` model the job's policy is back."""
        if self.resident == model_id:
            api.discard_gradients()
            self.resident = None
        self.parked.pop(model_id, None)
        shutil.rmtree(self.directory(model_id), ignore_errors=True)
        if last and self.resident != JOB and JOB in self.parked:
            api.resume_policy(self.directory(JOB), self.parked.pop(JOB))
            self.resident = JOB
            shutil.rmtree(self.directory(JOB), ignore_errors=True)
