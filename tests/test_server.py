"""The server as a network peer sees it: bad input over HTTP, tokens, caps, replays, ordering, concurrency."""

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from arctic_rl_core import wire
from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.client import ArcticRLClient, AsyncArcticRLClient, Unauthorized
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port, standalone_env
from arctic_rl_core.errors import BackendUnavailable
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.run import ServerThread, build_server
from tests.conftest import LIGHT_SAMPLER
from tests.helpers import grpo_batch

TOKEN = "s3cret-token"


@pytest.fixture
def server(tiny_model):
    settings = ServerSettings(port=free_loopback_port(), token=TOKEN, max_request_bytes=2**20)
    with ServerThread(settings, BackendConfig(model_path=tiny_model, engine={"learning_rate": 1e-3}, sampler=LIGHT_SAMPLER)) as url:
        yield url


def post(url, route, body, content_type=wire.MEDIA_TYPE, token=TOKEN, **headers):
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/v1/{route}", content=body, headers={"Content-Type": content_type, **auth, **headers})


def fwd_bwd_message(batch=None, loss="grpo"):
    batch = batch or grpo_batch(prompt_len=12, response_len=10)  # long enough to travel as tensors
    return {"sequences": [s.model_dump() for s in batch], "loss": {"name": loss}}


def garbled_dtype():
    data = bytearray(wire.encode(fwd_bwd_message()))
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "BF16"
    new = json.dumps(header).encode().ljust(header_len)
    return bytes(data[:8] + new + data[8 + header_len :])


def wrong_shape():
    data = bytearray(wire.encode(fwd_bwd_message()))
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1]
    new = json.dumps(header).encode().ljust(header_len)
    return bytes(data[:8] + new + data[8 + header_len :])


def float_token_ids():
    message = fwd_bwd_message()
    message["sequences"][0]["prompt_ids"] = np.arange(8, dtype=np.float32) + 0.5
    return wire.encode(message)


BAD = [
    ("malformed JSON", lambda: (b'{"sequences": [', "application/json"), 400, "body"),
    ("truncated safetensors", lambda: (wire.encode(fwd_bwd_message())[:-40], wire.MEDIA_TYPE), 400, "body"),
    ("garbled safetensors", lambda: (b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + b"x" * 9, wire.MEDIA_TYPE), 400, "body"),
    ("unsupported dtype", lambda: (garbled_dtype(), wire.MEDIA_TYPE), 400, "body"),
    ("wrong shape", lambda: (wrong_shape(), wire.MEDIA_TYPE), 400, "body"),
    ("floats for token ids", lambda: (float_token_ids(), wire.MEDIA_TYPE), 400, "sequences[0].prompt_ids[0]"),
    ("unknown loss", lambda: (wire.encode(fwd_bwd_message(loss="nope")), wire.MEDIA_TYPE), 400, "loss.name"),
    ("unknown field", lambda: (json.dumps({**fwd_bwd_message(), "extra": 1}).encode(), "application/json"), 400, "extra"),
    ("wrong content type", lambda: (b"x", "text/plain"), 400, "content-type"),
    ("body over the cap", lambda: (wire.encode({"x": np.zeros(2**18, dtype=np.float32)}), wire.MEDIA_TYPE), 413, "body"),
]


@pytest.mark.parametrize("name, make, status, field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_4xx_and_changes_nothing(server, name, make, status, field):
    client = ArcticRLClient(server, token=TOKEN, retries=0)
    client.fwd_bwd(grpo_batch(seed=1), "grpo")  # pending gradients must survive too
    client.step()
    digest = client.state_digest()
    body, content_type = make()
    response = post(server, "fwd_bwd", body, content_type)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"], error
    assert client.health() == {"status": "ok"}
    assert client.state_digest() == digest


def test_token_is_required_and_checked(server):
    client = ArcticRLClient(server, token=TOKEN, retries=0)
    digest = client.state_digest()
    for token in (None, "nope"):
        refused = post(server, "step", wire.encode({}), token=token)
        assert refused.status_code == 401 and refused.json()["error"]["field"] == "authorization"
        refused = post(server, "fwd_bwd", wire.encode(fwd_bwd_message()), token=token)
        assert refused.status_code == 401
    assert client.state_digest() == digest
    assert httpx.get(f"{server}/v1/health").status_code == 401
    wrong = httpx.get(f"{server}/v1/health", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["field"] == "authorization"
    assert httpx.get(f"{server}/openapi.json").status_code == 401  # every request, not just the API
    with pytest.raises(Unauthorized, match="wrong"):
        ArcticRLClient(server, token="nope", retries=0).health()
    ok = ArcticRLClient(server, token=TOKEN)
    assert ok.health() == {"status": "ok"}
    spec = httpx.get(f"{server}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert {"/v1/fwd_bwd", "/v1/generate", "/v1/sync_weights"} <= set(spec["paths"])
    assert "Sequence" in spec["components"]["schemas"]


def test_token_from_environment(server, monkeypatch):
    monkeypatch.setenv("ARCTIC_RL_TOKEN", TOKEN)
    assert ArcticRLClient(server).health() == {"status": "ok"}


def test_off_loopback_bind_requires_a_token(tiny_model):
    with pytest.raises(SystemExit, match="needs a token"):
        build_server(ServerSettings(host="0.0.0.0", port=free_loopback_port()))


def test_replayed_request_id_is_applied_once(server):
    client = ArcticRLClient(server, token=TOKEN, retries=0)
    body = wire.encode(fwd_bwd_message())
    first = post(server, "fwd_bwd", body, **{"X-Request-Id": "abc"})
    replay = post(server, "fwd_bwd", body, **{"X-Request-Id": "abc"})
    assert first.status_code == replay.status_code == 200
    assert wire.decode(first.content) == wire.decode(replay.content)  # the first outcome, not a second run
    conflict = post(server, "fwd_bwd", wire.encode(fwd_bwd_message(grpo_batch(seed=5))), **{"X-Request-Id": "abc"})
    assert conflict.status_code == 409 and conflict.json()["error"]["field"] == "X-Request-Id"
    once = client.step().grad_norm
    # Compare with a fresh server that applied the batch exactly once.
    reference = InProcessBackend({"model_path": client.status()["config"]["model_path"], "engine": {"learning_rate": 1e-3},
                                  "sampler": LIGHT_SAMPLER})
    reference.fwd_bwd(grpo_batch(prompt_len=12, response_len=10), "grpo")
    assert once == pytest.approx(reference.step().grad_norm, rel=1e-6)


def test_ordered_calls_apply_in_order_and_reads_do_not_wait(tiny_model):
    """A generate completes while a fwd_bwd is still running; futures keep training calls in order."""
    gate = threading.Event()
    started = threading.Event()

    class SlowBackend(InProcessBackend):
        def fwd_bwd(self, sequences, loss, **options):
            started.set()
            assert gate.wait(30)
            return super().fwd_bwd(sequences, loss, **options)

    settings = ServerSettings(port=free_loopback_port())
    with ServerThread(settings, BackendConfig(model_path=tiny_model, sampler=LIGHT_SAMPLER), backend_factory=SlowBackend) as url:
        client = ArcticRLClient(url, retries=0)
        training = client.futures.fwd_bwd(grpo_batch(), "grpo")
        stepped = client.futures.step()
        assert started.wait(30)
        completions = client.futures.generate([[5, 6, 7]], {"n": 2, "max_tokens": 4}).result(timeout=30)
        assert len(completions) == 2 and not training.done() and not stepped.done()
        gate.set()
        assert training.result(timeout=60).num_sequences == 6
        assert stepped.result(timeout=60).step == 1  # the step came after the fwd_bwd it needed


def test_async_client(server):
    import asyncio

    async def main():
        client = AsyncArcticRLClient(server, token=TOKEN, retries=0)
        generate = asyncio.create_task(client.generate([[5, 6, 7]], {"n": 3, "max_tokens": 5, "seed": 2}))
        result = await client.fwd_bwd(grpo_batch(), "grpo")
        stepped = await client.step()
        version = await client.sync_weights()
        completions = await generate
        await client.aclose()
        return result, stepped, version, completions

    result, stepped, version, completions = asyncio.run(main())
    assert result.num_sequences == 6 and stepped.step == 1 and version == 1 and len(completions) == 3


def test_connection_loss_is_a_clear_error():
    client = ArcticRLClient(f"http://127.0.0.1:{free_loopback_port()}", retries=2, backoff_s=0.01)
    with pytest.raises(BackendUnavailable, match="after 3 attempts"):
        client.fwd_bwd(grpo_batch(), "grpo")


def test_calls_before_initialize_and_initialize_over_http(tiny_model):
    settings = ServerSettings(port=free_loopback_port())
    with ServerThread(settings) as url:
        client = ArcticRLClient(url, retries=0)
        assert client.status()["initialized"] is False
        response = httpx.post(f"{url}/v1/step", json={})
        assert response.status_code == 409 and "initialize" in response.json()["error"]["message"]
        bad = httpx.post(f"{url}/v1/initialize", json={"model_path": tiny_model, "engine": {"zero_stagee": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "engine.zero_stagee"
        client.initialize({"model_path": tiny_model, "sampler": LIGHT_SAMPLER})
        assert client.status()["initialized"] is True and client.weight_version == 0
        other = httpx.post(f"{url}/v1/initialize", json={"model_path": tiny_model, "engine": {"zero_stage": 1},
                                                         "sampler": LIGHT_SAMPLER})
        assert other.status_code == 409 and other.json()["error"]["type"] == "JobConflict"
        assert settings.temporary_checkpoint_dir and os.path.isdir(settings.checkpoint_dir)
    assert not os.path.exists(settings.checkpoint_dir)  # nothing saved: the temporary directory is gone


def answering(proc: subprocess.Popen, port: int) -> tuple[ArcticRLClient, dict]:
    """A client of the server `proc` started on `port`, and its status, once it answers: however long this machine
    takes to load the job, as long as the process lives."""
    client = ArcticRLClient(f"http://127.0.0.1:{port}", retries=0)
    deadline = time.monotonic() + 600
    while True:
        try:
            return client, client.status()
        except BackendUnavailable:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "no answer"
            time.sleep(0.5)


def test_serve_command_line(tiny_model, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(f"model_path: {tiny_model}\nengine:\n  zero_stage: 1\n")
    port = free_loopback_port()
    cli = os.path.join(os.path.dirname(sys.executable), "arctic-rl")
    env = standalone_env()
    proc = subprocess.Popen([cli, "serve", "--port", str(port), "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client, status = answering(proc, port)
        assert status["config"]["engine"]["zero_stage"] == 1
        assert len(client.generate([[5, 6]], {"max_tokens": 3})) == 1
        # A second server on the port held is refused before it loads its job, naming the flag.
        taken = subprocess.run([cli, "serve", "--port", str(port), "--config", str(config)], env=env,
                               capture_output=True, text=True, timeout=120)
        assert taken.returncode != 0 and f"--port {port}: 127.0.0.1:{port} cannot be bound" in taken.stderr, taken
        assert "serving on" not in taken.stdout and "Loading" not in taken.stderr, taken
        client.shutdown()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    refused = subprocess.run([cli, "serve", "--host", "0.0.0.0", "--port", str(port)], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "needs a token" in refused.stderr


# `arctic-rl serve` with its job's close recorded in a file (the server and the signal are real).
_SERVE_RECORDING_CLOSE = """
import sys
import arctic_rl_core.server.run as run
from arctic_rl_core.cli import main

real, record = run.close_job, sys.argv.pop(1)
run.close_job = lambda server: (real(server), open(record, "w").write("closed"))
sys.exit(main())
"""


def test_serve_stopped_by_sigterm_closes_its_job_then_ends_by_the_signal(tmp_path):
    """What a job started outside the server's process (a sampler's engine core of its own, Ray actors) is stopped
    by the job's close. uvicorn raises SIGTERM again under the handler it found once it has shut down: under the
    default one the process ended there, before the close."""
    port, record = free_loopback_port(), tmp_path / "closed"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_RECORDING_CLOSE, str(record), "serve", "--port", str(port),
                             "--checkpoint-dir", str(tmp_path / "checkpoints")], env=standalone_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        answering(proc, port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM, proc.stdout.read()
        assert record.read_text() == "closed"
    finally:
        proc.kill()


def test_status_reports_the_model_shape_and_what_was_generated(server, tiny_model):
    from transformers import AutoConfig

    client = ArcticRLClient(server, token=TOKEN)
    before = client.status()["backend"]
    hf = AutoConfig.from_pretrained(tiny_model)
    assert before["model"]["vocab_size"] == hf.vocab_size and before["model"]["model_type"] == "qwen3"
    assert before["generated"] == {"calls": 0, "completions": 0, "tokens": 0}
    completions = client.generate([[5, 6, 7]], {"n": 3, "max_tokens": 4})
    after = client.status()["backend"]["generated"]
    assert after == {"calls": 1, "completions": 3, "tokens": sum(len(c.token_ids) for c in completions)}
