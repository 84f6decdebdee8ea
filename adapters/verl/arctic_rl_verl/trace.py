"""Where verl's phases spend their time inside the adapter, when `ARCTIC_RL_VERL_TRACE` names a file.

Each record is one JSON line: the rollout server writes one per `generate` call (verl's step, its requests,
wall-clock times of the first request's arrival, the call's start and end, and the last answer handed
back); the training engine one per `forward_backward_batch` (its time in the adapter, and in the client
call). verl's own timings (`timing_s/*`) less these are verl's share; the project's verl benchmark reads
them (compat_tests/verl/bench_phases.py).
"""

from __future__ import annotations

import json
import os

TRACE_ENV = "ARCTIC_RL_VERL_TRACE"


def record(kind: str, **fields) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")
