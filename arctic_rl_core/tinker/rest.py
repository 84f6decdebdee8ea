"""The Tinker SDK's `RestClient` on `arctic-rl serve`: a tenant's training runs, their checkpoints and its sessions,
listed, looked up and deleted (SDK 0.38's routes and response models).

A training run is a Tinker model (`<session>:train:<n>`). Its record (`run.json`: base model, LoRA rank, its
session, user metadata) is written beside its checkpoints when it is made, so runs and their training checkpoints
(`weights/<name>`: `save_state`) outlive the server; sampler checkpoints (`sampler_weights/<name>`) are what the
sampler serves now, and are listed while it does. Everything is confined to the asking tenant: another's run,
checkpoint or session is a 404, as one that does not exist.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from typing import Any, Callable

from fastapi import FastAPI, Request, Response

from arctic_rl_core.errors import InvalidRequest, NotFound

RUN_FILE = "run.json"
KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""A tinker path's segment -> the checkpoint type the SDK names it."""
MAX_PAGE = 1000


def record_run(folder: str, run: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, RUN_FILE), "w") as f:
        json.dump(run, f)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    values = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        raw = request.query_params.get(name, str(default))
        if not raw.isdigit() or name == "limit" and not 1 <= int(raw) <= MAX_PAGE:
            raise InvalidRequest(name, f"must be an integer{' from 1 to ' + str(MAX_PAGE) if name == 'limit' else ''}"
                                       f" (got {raw!r})")
        values.append(int(raw))
    return values[0], values[1]


def add_rest_routes(app: FastAPI, state, prefix: str, tenant: Callable[[Request], str],
                    tenant_folder: Callable[[str], str], forget_sampler_path: Callable[[str], None]) -> None:
    """`tenant_folder(who)`: where a tenant's runs lie (a folder per run); `forget_sampler_path(path)`: the sampler
    stops serving what was saved under `path`."""

    def runs_of(who: str) -> dict[str, tuple[str, dict]]:
        """The tenant's runs: id -> (folder, record)."""
        root, found = tenant_folder(who), {}
        for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            try:
                with open(os.path.join(root, entry, RUN_FILE)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue  # the residency's parked states and folders of no run
            found[record["training_run_id"]] = (os.path.join(root, entry), record)
        return found

    def run_of(who: str, run_id: str) -> tuple[str, dict]:
        run = runs_of(who).get(run_id)
        if run is None:
            raise NotFound("training_run_id", f"no training run {run_id!r} on this server")
        return run

    def checkpoints(who: str, run_id: str, folder: str) -> list[dict]:
        """The run's training checkpoints on disk and the sampler checkpoints served now, oldest first."""
        found = []
        saved = os.path.join(folder, "weights")
        for name in sorted(os.listdir(saved)) if os.path.isdir(saved) else []:
            path = os.path.join(saved, name)
            found.append({"checkpoint_id": f"weights/{name}", "checkpoint_type": "training",
                          "time": _iso(os.path.getmtime(path)), "tinker_path": f"tinker://{run_id}/weights/{name}",
                          "size_bytes": _size(path), "public": False, "expires_at": None})
        head = f"tinker://{run_id}/sampler_weights/"
        for path, weights in state.sampler_paths.items():
            if path.startswith(head) and weights.tenant == who:
                found.append({"checkpoint_id": path[len("tinker://" + run_id) + 1:], "checkpoint_type": "sampler",
                              "time": _iso(weights.saved), "tinker_path": path, "size_bytes": None, "public": False,
                              "expires_at": None})
        return sorted(found, key=lambda c: c["time"])

    def training_run(who: str, run_id: str, folder: str, record: dict) -> dict:
        listed = checkpoints(who, run_id, folder)
        model = state.models.get(run_id)
        heard = max([record["created"], os.path.getmtime(folder)] +
                    ([state.sessions[model.session_id].seen] if model is not None else []))
        last = {kind: next((c for c in reversed(listed) if c["checkpoint_type"] == kind), None)
                for kind in ("training", "sampler")}
        return {"training_run_id": run_id, "base_model": record["base_model"], "model_owner": who,
                "is_lora": record["is_lora"], "lora_rank": record["lora_rank"], "corrupted": False,
                "last_request_time": _iso(heard), "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"], "user_metadata": record.get("user_metadata")}

    @app.get(f"{prefix}/training_runs")
    async def list_training_runs(request: Request):
        who = tenant(request)
        limit, offset = _page(request, 20)
        runs = runs_of(who)
        newest = sorted(runs.items(), key=lambda item: -item[1][1]["created"])
        return {"training_runs": [training_run(who, run_id, folder, record)
                                  for run_id, (folder, record) in newest[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    @app.get(f"{prefix}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request):
        who = tenant(request)
        return training_run(who, run_id, *run_of(who, run_id))

    @app.get(f"{prefix}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        who = tenant(request)
        folder, _ = run_of(who, run_id)
        return {"checkpoints": checkpoints(who, run_id, folder), "cursor": None}

    @app.get(f"{prefix}/checkpoints")
    async def list_user_checkpoints(request: Request):
        who = tenant(request)
        limit, offset = _page(request, 100)
        found = [c for run_id, (folder, _) in runs_of(who).items() for c in checkpoints(who, run_id, folder)]
        found.sort(key=lambda c: c["time"], reverse=True)  # newest first
        return {"checkpoints": found[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}

    # Sharing and expiry are refused with a 400 (the SDK retries a 409 for minutes).
    def refuse_sharing(run_id: str, kind: str, name: str, request: Request):
        tenant(request)
        raise InvalidRequest("tinker_path", "this server's checkpoints are its tenants' own: none is published or "
                                            "expires (delete_checkpoint removes one)")

    for suffix, methods in (("publish", ["POST", "DELETE"]), ("ttl", ["PUT"])):
        app.add_api_route(f"{prefix}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/{suffix}", refuse_sharing,
                          methods=methods)

    @app.delete(f"{prefix}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
        who = tenant(request)
        folder, _ = run_of(who, run_id)
        path = f"tinker://{run_id}/{kind}/{name}"
        if kind == "weights":
            saved = os.path.join(folder, "weights", name)
            if os.sep in name or name in (".", "..") or not os.path.isdir(saved):
                raise NotFound("checkpoint_id", f"no checkpoint {path!r} on this server")
            shutil.rmtree(saved)
        elif kind == "sampler_weights":
            weights = state.sampler_paths.get(path)
            if weights is None or weights.tenant != who:
                raise NotFound("checkpoint_id", f"no checkpoint {path!r} on this server")
            forget_sampler_path(path)
        else:
            raise NotFound("checkpoint_id", f"no checkpoint {path!r} on this server")
        return Response(status_code=204)

    # -- sessions ----------------------------------------------------------------------------------------------

    @app.get(f"{prefix}/sessions")
    async def list_sessions(request: Request):
        who = tenant(request)
        limit, offset = _page(request, 20)
        own = sorted((s for s, found in state.sessions.items() if found.tenant == who),
                     key=lambda s: -state.sessions[s].seen)
        return {"sessions": own[offset:offset + limit]}

    @app.get(f"{prefix}/sessions/{{session_id}}")
    async def get_session(session_id: str, request: Request):
        who = tenant(request)
        found = state.sessions.get(session_id)
        if found is None or found.tenant != who:
            raise NotFound("session_id", f"no session {session_id!r} on this server")
        return {"training_run_ids": [run_id for run_id, (_, record) in runs_of(who).items()
                                     if record["session_id"] == session_id],
                "sampler_ids": [k for k, s in state.samplers.items() if s.session_id == session_id],
                "user_metadata": found.user_metadata, "display_name": None}
