"""Checkpoints a framework saves through the training API when its machine and the server share no disk.

The server writes the checkpoint under its own checkpoint folder, at a name derived from the folder
the framework saves into; the framework's folder receives a small record of which checkpoint that is
(and whatever the adapter needs to resume, such as its learning-rate schedule's position). Resuming
reads the record and loads the server's checkpoint. The same works when the disk is shared.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from arctic_rl_core.api import TrainingAPI

RECORD_FILE = "arctic_rl_checkpoint.json"


class NoCheckpointRecord(FileNotFoundError):
    """The folder was not saved through the training API."""


def server_name(framework: str, local_dir: str) -> str:
    """`<framework>/<run>/<step folder>/<role folder>`: the run is the folder holding the step folders, hashed, so
    two runs never share a name; the last two components keep the framework's own layout readable."""
    local_dir = os.path.abspath(local_dir)
    step_dir, role = os.path.split(local_dir)
    run_dir, step = os.path.split(step_dir)
    run = hashlib.sha256(run_dir.encode()).hexdigest()[:16]
    return os.path.join(framework, run, step, role)


def save(api: TrainingAPI, framework: str, local_dir: str, **extra: Any) -> dict[str, Any]:
    """Save the job's state on the server and record it in `local_dir`; the record."""
    name = server_name(framework, local_dir)
    info = api.save_checkpoint(name)
    record = {"name": name, "server_path": info.path, "step": info.step, "weight_version": info.weight_version, **extra}
    os.makedirs(local_dir, exist_ok=True)
    with open(os.path.join(local_dir, RECORD_FILE), "w") as f:
        json.dump(record, f)
    return record


def load(api: TrainingAPI, local_dir: str, optimizer: bool = True) -> dict[str, Any]:
    """Load the server's checkpoint that `local_dir` records (`optimizer=False`: its weights only); the record."""
    try:
        with open(os.path.join(local_dir, RECORD_FILE)) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise NoCheckpointRecord(f"{local_dir} was not saved through Arctic RL (no {RECORD_FILE})") from None
    api.load_checkpoint(record["name"], optimizer=optimizer)
    return record
