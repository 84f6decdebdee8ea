"""The Tinker SDK's `RestClient` on `arctic-rl serve`: a tenant's training runs, their checkpoints and its sessions,
listed, looked up and deleted, and exported weights downloaded (SDK 0.38's routes and response models).

A training run is a Tinker model (`<session>:train:<n>`). Its record (`run.json`: base model, LoRA rank, its
session, user metadata) is written beside its checkpoints when it is made, so runs and their checkpoints on disk
(`weights/<name>`: `save_state`; `external_weights/<name>`: `save_weights_external`) outlive the server; sampler
checkpoints (`sampler_weights/<name>`) are the saves this server process keeps for its sampler, listed while kept. A checkpoint
on disk may be given a TTL; past it, it is deleted when next looked at. Everything is confined to the asking
tenant: another's run, checkpoint or session is a 404, as one that does not exist.

Exported weights download as Tinker's do, through signed URLs (`get_external_weights_urls`): each file's URL holds
an unguessable token that expires in `URL_TTL_S`, and is fetched without the API key (the SDK's CLI fetches them
with a plain GET), so `GuardMiddleware` lets `SIGNED_PREFIX` through on the token alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from datetime import datetime, timezone
from typing import Any, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse

from arctic_rl_core.errors import InvalidRequest, NotFound
from arctic_rl_core.server.security import SIGNED_PREFIX, confine

RUN_FILE = "run.json"
ON_DISK = {"weights": "training", "external_weights": "external"}
"""A tinker path's segment -> the checkpoint type the SDK names it (sampler checkpoints are kept by the process)."""
EXPIRES_SUFFIX = ".expires"
"""Beside a checkpoint's folder: when it expires (epoch seconds)."""
MAX_PAGE = 1000
URL_TTL_S = 900
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400
"""Tinker's bounds on a checkpoint's TTL."""


def record_run(folder: str, run: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, RUN_FILE), "w") as f:
        json.dump(run, f)


def size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def expiry(ttl_seconds: Any, field: str) -> float | None:
    """When a checkpoint given `ttl_seconds` expires; None: never."""
    if ttl_seconds is None:
        return None
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidRequest(field, f"must be null or seconds from {MIN_TTL_S} to {MAX_TTL_S} (got {ttl_seconds!r})")
    return time.time() + ttl_seconds


def set_expiry(folder: str, expires: float | None) -> None:
    marker = folder + EXPIRES_SUFFIX
    if expires is None:
        if os.path.exists(marker):
            os.remove(marker)
        return
    with open(marker, "w") as f:
        f.write(repr(expires))


def _expires(folder: str) -> float | None:
    try:
        with open(folder + EXPIRES_SUFFIX) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def _delete(folder: str) -> None:
    shutil.rmtree(folder)
    set_expiry(folder, None)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


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
                    read_json: Callable[[Request], Any], tenant_folder: Callable[[str], str],
                    forget_sampler_path: Callable[[str], None]) -> None:
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

    def on_disk(folder: str, kind: str) -> list[str]:
        """The run's live checkpoints of `kind` (a checkpoint past its TTL is deleted here)."""
        root, names = os.path.join(folder, kind), []
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            path = os.path.join(root, name)
            if not os.path.isdir(path) or name.endswith(".partial"):
                continue  # expiry markers, and an export being written
            expires = _expires(path)
            if expires is not None and expires <= time.time():
                _delete(path)
                continue
            names.append(name)
        return names

    def checkpoint_folder(who: str, run_id: str, kind: str, name: str) -> str:
        folder, _ = run_of(who, run_id)
        if kind not in ON_DISK or name not in on_disk(folder, kind):
            raise NotFound("checkpoint_id", f"no checkpoint tinker://{run_id}/{kind}/{name} on this server")
        return os.path.join(folder, kind, name)

    def checkpoints(who: str, run_id: str, folder: str) -> list[dict]:
        """The run's checkpoints on disk and the sampler checkpoints served now, oldest first."""
        found = []
        for kind, kind_name in ON_DISK.items():
            for name in on_disk(folder, kind):
                path = os.path.join(folder, kind, name)
                expires = _expires(path)
                found.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": kind_name,
                              "time": _iso(os.path.getmtime(path)), "tinker_path": f"tinker://{run_id}/{kind}/{name}",
                              "size_bytes": size(path), "public": False,
                              "expires_at": None if expires is None else _iso(expires)})
        head = f"tinker://{run_id}/sampler_weights/"
        for path, weights in state.sampler_paths.items():
            if path.startswith(head) and weights.tenant == who:
                kept = state.kept.get(weights.kept)
                found.append({"checkpoint_id": path[len("tinker://" + run_id) + 1:], "checkpoint_type": "sampler",
                              "time": _iso(weights.saved), "tinker_path": path,
                              "size_bytes": size(kept.folder) if kept is not None else None, "public": False,
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

    @app.delete(f"{prefix}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
        who = tenant(request)
        if kind == "sampler_weights":
            run_of(who, run_id)
            path = f"tinker://{run_id}/{kind}/{name}"
            weights = state.sampler_paths.get(path)
            if weights is None or weights.tenant != who:
                raise NotFound("checkpoint_id", f"no checkpoint {path!r} on this server")
            forget_sampler_path(path)
        else:
            _delete(checkpoint_folder(who, run_id, kind, name))
        return Response(status_code=204)

    @app.put(f"{prefix}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, request: Request):
        who = tenant(request)
        body = await read_json(request)
        if kind == "sampler_weights":
            raise InvalidRequest("tinker_path", "a sampler checkpoint lasts while the server keeps it: no TTL")
        folder = checkpoint_folder(who, run_id, kind, name)
        set_expiry(folder, expiry(body.get("ttl_seconds") if isinstance(body, dict) else None, "ttl_seconds"))
        return Response(status_code=204)

    # Sharing is refused with a 400 (the SDK retries a 409 for minutes).
    def refuse_sharing(run_id: str, kind: str, name: str, request: Request):
        tenant(request)
        raise InvalidRequest("tinker_path", "this server's checkpoints are its tenants' own: none is published")

    app.add_api_route(f"{prefix}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish", refuse_sharing,
                      methods=["POST", "DELETE"])

    # -- downloads ---------------------------------------------------------------------------------------------

    @app.get(f"{prefix}/training_runs/{{run_id}}/checkpoints/external_weights/{{name}}/external_weights_urls")
    async def external_weights_urls(run_id: str, name: str, request: Request):
        who = tenant(request)
        folder = checkpoint_folder(who, run_id, "external_weights", name)
        now = time.time()
        for token in [t for t, (_, until) in state.downloads.items() if until <= now]:
            del state.downloads[token]
        token, expires = secrets.token_urlsafe(32), now + URL_TTL_S
        state.downloads[token] = (folder, expires)
        base = f"{str(request.base_url).rstrip('/')}{SIGNED_PREFIX}{token}/"
        files = sorted(os.path.relpath(os.path.join(root, n), folder) for root, _, names in os.walk(folder) for n in names)
        return {"urls": {rel: base + rel for rel in files}, "expires": _iso(expires)}

    @app.get(f"{SIGNED_PREFIX}{{token}}/{{relpath:path}}")
    async def signed_file(token: str, relpath: str):
        found = state.downloads.get(token)
        if found is None or found[1] <= time.time():
            raise NotFound("token", "no such download, or its URL expired: ask for the URLs again")
        try:
            path = confine(found[0], relpath)
        except InvalidRequest:
            raise NotFound("path", f"no file {relpath!r} in this download") from None
        if not os.path.isfile(path):
            raise NotFound("path", f"no file {relpath!r} in this download")
        return FileResponse(path)

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
