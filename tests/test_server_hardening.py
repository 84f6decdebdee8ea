"""The server against a hostile or careless client: every refusal is a 4xx naming the field, the server
stays up, and weights, optimizer state and step count are as they were (issue 12's list, one test each)."""

import json
import os
import pickle
import socket

import httpx
import numpy as np
import pytest
import torch

from arctic_rl_core import wire
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.limits import RequestLimits
from arctic_rl_core.server.run import ServerThread
from tests.conftest import LIGHT_SAMPLER
from tests.helpers import grpo_batch

TOKEN = "hardening-token"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """One loopback server with a token and small caps, and one without a token, over the same kind of job. Their
    header and body deadlines are generous (a 4 MiB header is parsed in time on a loaded machine): the test of the
    deadlines runs servers of its own."""
    root = tmp_path_factory.mktemp("checkpoints")
    limits = RequestLimits(prompts_per_call=8, samples_per_prompt=4, max_tokens=16, stop_strings=2,
                           stop_string_chars=32, generated_tokens_per_call=200, sequences_per_call=32,
                           routed_expert_ids_per_call=1000)
    config = BackendConfig(model_path=tiny_model, engine={"learning_rate": 1e-3, "micro_batch_tokens": 40},
                           sampler=LIGHT_SAMPLER)
    with ServerThread(ServerSettings(port=free_loopback_port(), token=TOKEN, max_request_bytes=4 * 2**20,
                                     checkpoint_dir=str(root), limits=limits, header_timeout_s=60.0,
                                     body_timeout_s=60.0), config) as url:
        with ServerThread(ServerSettings(port=free_loopback_port()), config) as open_url:
            yield {"url": url, "root": str(root), "open_url": open_url}


@pytest.fixture
def client(served):
    return ArcticRLClient(served["url"], token=TOKEN, retries=0)


def post(url, route, body, content_type="application/json", token=TOKEN, **headers):
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    return httpx.post(f"{url}/v1/{route}", content=body, headers={"Content-Type": content_type, **auth, **headers},
                      timeout=60)


def state(client) -> tuple:
    """Weights + optimizer digest and the step count."""
    return client.state_digest(), client.status()["backend"]["optimizer_steps"]


def refused(response, status, field):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"], error
    return error


@pytest.fixture
def trained(client):
    """A job that has stepped once, so the optimizer has state to lose."""
    client.fwd_bwd(grpo_batch(seed=11), "grpo")
    client.step()
    return state(client)


# 1. No code execution through load_checkpoint --------------------------------------------------------


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling this creates the marker file


def test_a_crafted_pickle_in_a_checkpoint_runs_nothing(served, client, trained, tmp_path):
    client.save_checkpoint("good")
    marker = tmp_path / "pwned"
    states = os.path.join(served["root"], "good", "state")
    victim = next(f for f in os.listdir(states) if f.endswith("model_states.pt"))
    with open(os.path.join(states, victim), "wb") as f:
        pickle.dump({"module": _Payload(str(marker))}, f)
    torch.save({"x": _Payload(str(marker))}, os.path.join(served["root"], "evil.pt"))
    error = refused(post(served["url"], "load_checkpoint", {"path": "good"}), 400, "path")
    assert "not a safe Arctic RL checkpoint" in error["message"]
    assert not marker.exists()
    assert state(client) == trained and client.health() == {"status": "ok"}


def test_a_checkpoint_of_another_model_is_refused_before_loading(served, client, trained, tiny_models):
    other = ArcticRLClient(served["open_url"], retries=0)  # same job kind, then a different model's checkpoint
    from arctic_rl_core.backend import InProcessBackend

    llama = InProcessBackend({"model_path": tiny_models["llama"], "sampler": LIGHT_SAMPLER})
    llama.save_checkpoint(os.path.join(served["root"], "llama"))
    error = refused(post(served["url"], "load_checkpoint", {"path": "llama"}), 400, "path")
    assert "another model" in error["message"]
    assert state(client) == trained and other.health() == {"status": "ok"}


# 2. Checkpoint paths are confined ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["ck0/../../x/../escaped", "/tmp/elsewhere", "..", "link/inside"])
def test_checkpoint_paths_stay_inside_the_checkpoint_directory(served, client, trained, path, tmp_path):
    os.makedirs(tmp_path / "outside", exist_ok=True)
    link = os.path.join(served["root"], "link")
    if not os.path.lexists(link):
        os.symlink(tmp_path / "outside", link)  # a symlink out of the root is followed, then refused
    for route in ("save_checkpoint", "load_checkpoint"):
        error = refused(post(served["url"], route, {"path": path}), 400, "path")
        assert "outside the server's checkpoint directory" in error["message"]
    assert not os.listdir(tmp_path / "outside") and not os.path.exists(os.path.join(os.path.dirname(served["root"]), "escaped"))
    assert state(client) == trained
    inside = client.save_checkpoint("nested/ck1")  # relative paths land inside the root
    assert inside.path == os.path.join(served["root"], "nested", "ck1")


# 3. Non-finite learning rates and updates ------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    (b'{"learning_rate": Infinity}', "learning_rate"),
    (b'{"learning_rate": NaN}', "learning_rate"),
    (b'{"learning_rate": 1e300}', "learning_rate"),
])
def test_a_step_with_a_non_finite_learning_rate_is_refused(served, client, trained, body, field):
    client.fwd_bwd(grpo_batch(seed=3), "grpo")
    refused(post(served["url"], "step", body), 400, field)
    assert state(client) == trained
    client.discard_gradients()


def test_an_update_that_would_make_weights_non_finite_is_refused_before_it_touches_them(served, client, trained):
    batch = grpo_batch(seed=4)
    for s in batch:  # importance ratios of exp(1e30): an infinite loss and infinite gradients
        s.behaviour_logprobs = [-1e30] * len(s.response_ids)
        s.advantages = [-1.0] * len(s.response_ids)
    message = {"sequences": [s.model_dump() for s in batch], "loss": {"name": "grpo"}}
    refused(post(served["url"], "fwd_bwd", message), 400, "loss")
    refused(post(served["url"], "step", {}), 400, "step")  # nothing was accumulated, so nothing can be applied
    assert state(client) == trained


# 4. fwd_bwd is all-or-nothing; discard_gradients -------------------------------------------------------


def poisoned(seed):
    """A batch whose last group (sorted last, so in a later micro-batch) has an infinite loss."""
    batch = grpo_batch(groups=3, seed=seed)
    for s in batch[-3:]:
        s.prompt_ids = [399] * len(s.prompt_ids)
        s.behaviour_logprobs = [-1e30] * len(s.response_ids)
        s.advantages = [-1.0] * len(s.response_ids)
    return batch


def test_a_failed_fwd_bwd_leaves_the_earlier_gradients_exactly(tiny_model):
    from arctic_rl_core.backend import InProcessBackend

    config = {"model_path": tiny_model, "engine": {"learning_rate": 1e-3, "micro_batch_tokens": 40}, "sampler": LIGHT_SAMPLER}
    with ServerThread(ServerSettings(port=free_loopback_port()), BackendConfig(**config)) as url:
        client = ArcticRLClient(url, retries=0)
        client.fwd_bwd(grpo_batch(seed=5), "grpo")
        before = state(client)
        error = refused(post(url, "fwd_bwd", {"sequences": [s.model_dump() for s in poisoned(6)],
                                              "loss": {"name": "grpo"}}, token=None), 400, "loss")
        assert "micro-batch 1" in error["message"]  # the first micro-batch had already accumulated
        assert state(client) == before
        stepped = client.step()
        # The reference applied only the good batch, from the same initial weights.
        reference = InProcessBackend(config)
        reference.fwd_bwd(grpo_batch(seed=5), "grpo")
        assert stepped.grad_norm == reference.step().grad_norm
        assert client.state_digest() == reference.state_digest()


def test_discard_gradients_drops_a_pending_accumulation(served, client, trained):
    client.fwd_bwd(grpo_batch(seed=7), "grpo")
    assert post(served["url"], "discard_gradients", {}).status_code == 200
    refused(post(served["url"], "step", {}), 400, "step")
    assert state(client) == trained


# 5. 400s, not 500s, for numbers the engines cannot hold --------------------------------------------------


def seq_message(**loss_config):
    return {"sequences": [s.model_dump() for s in grpo_batch(seed=8)], "loss": {"name": "grpo", "config": loss_config}}


BAD_NUMBERS = [
    ("fwd_bwd", json.dumps(seq_message()).replace('"config": {}', '"config": {"entropy_coeff": NaN}'), "loss.config.entropy_coeff"),
    ("fwd_bwd", seq_message(current_version=1e40, use_decoupled_loss=True, prox_logp_method="loglinear"), "loss.config.current_version"),
    ("generate", {"prompts": [[5, 6]], "sampling": {"seed": 2**70}}, "sampling.seed"),
    ("generate", {"prompts": [[5, 6]], "sampling": {"temperature": 1e-300}}, "sampling"),
    ("log_probs", {"sequences": [s.model_dump() for s in grpo_batch(seed=8)], "temperature": 1e-320}, "temperature"),
    ("initialize", {"model_path": "/etc"}, "model_path"),
]


@pytest.mark.parametrize("route, body, field", BAD_NUMBERS, ids=[f"{r}-{f}" for r, _, f in BAD_NUMBERS])
def test_numbers_the_engines_cannot_hold_are_400s(served, client, trained, route, body, field):
    url = served["open_url"] if route == "initialize" else served["url"]
    if route == "initialize":  # on a server without a job
        with ServerThread(ServerSettings(port=free_loopback_port())) as url:
            refused(post(url, route, body, token=None), 400, field)
            assert httpx.get(f"{url}/v1/health").json() == {"status": "ok"}
        return
    refused(post(url, route, body if isinstance(body, (bytes, str)) else json.dumps(body)), 400, field)
    assert state(client) == trained


def test_log_probs_over_the_wire_refuses_a_tiny_temperature_instead_of_answering_nan(served, client):
    message = {"sequences": [s.model_dump() for s in grpo_batch(prompt_len=12, response_len=10)], "temperature": 1e-320}
    refused(post(served["url"], "log_probs", wire.encode(message), wire.MEDIA_TYPE), 400, "temperature")
    ok = post(served["url"], "log_probs", wire.encode({**message, "temperature": 0.5}), wire.MEDIA_TYPE)
    assert ok.status_code == 200 and np.isfinite(np.concatenate(wire.decode(ok.content, arrays=True)["logprobs"])).all()


# 6. Work per request is capped ------------------------------------------------------------------------


CAPS = [
    ({"prompts": [[5, 6]], "sampling": {"stop": ["x" * 1_000_000], "max_tokens": 8}}, "sampling.stop[0]", "stop_string_chars"),
    ({"prompts": [[5, 6]], "sampling": {"stop": ["a", "b", "c"], "max_tokens": 8}}, "sampling.stop", "stop_strings"),
    ({"prompts": [[5, 6]], "sampling": {"n": 100_000, "max_tokens": 8}}, "sampling.n", "samples_per_prompt"),
    ({"prompts": [[5, 6]] * 9, "sampling": {"max_tokens": 8}}, "prompts", "prompts_per_call"),
    ({"prompts": [[5, 6]], "sampling": {"max_tokens": 17}}, "sampling.max_tokens", "max_tokens"),
    ({"prompts": [[5, 6]] * 8, "sampling": {"n": 4, "max_tokens": 16}}, "sampling", "generated_tokens_per_call"),
]


@pytest.mark.parametrize("body, field, limit", CAPS, ids=[c[2] for c in CAPS])
def test_generate_work_is_capped(served, client, body, field, limit):
    before = client.status()["backend"]["generated"]
    error = refused(post(served["url"], "generate", body), 413, field)
    assert limit in error["message"]
    assert client.status()["backend"]["generated"] == before  # the sampler never ran


def test_training_calls_are_capped_by_sequence_count(served, client, trained):
    batch = grpo_batch(groups=11, group_size=3)  # 33 sequences > 32
    error = refused(post(served["url"], "fwd_bwd", {"sequences": [s.model_dump() for s in batch], "loss": {"name": "grpo"}}),
                    413, "sequences")
    assert "sequences_per_call" in error["message"]
    assert state(client) == trained


def test_training_calls_are_capped_by_routing_record_size(served, client, trained):
    batch = grpo_batch(groups=2, group_size=2)
    records = [{"ids": [0, 1] * (64 * (len(s.prompt_ids) + len(s.response_ids))), "layers": 32, "top_k": 4} for s in batch]
    body = {"sequences": [{**s.model_dump(), "routed_experts": r} for s, r in zip(batch, records)], "loss": {"name": "grpo"}}
    error = refused(post(served["url"], "fwd_bwd", body), 413, "sequences")  # before the model sees a record
    assert "routed_expert_ids_per_call" in error["message"]
    assert state(client) == trained


# 7. Wire-format reference bomb -----------------------------------------------------------------------


def test_references_to_one_tensor_cannot_decode_bigger_than_the_body(served, client, trained):
    n = 100_000
    body = bytearray(wire.encode({"sequences": [{"prompt_ids": np.arange(n, dtype=np.int64) % 300,
                                                 "response_ids": [5] * 8}], "loss": {"name": "grpo"}}))
    header_len = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + header_len])
    structure = json.loads(header["__metadata__"]["arctic_rl"])
    ref = structure["sequences"][0]["prompt_ids"]
    structure["sequences"] = [{"prompt_ids": ref, "response_ids": [5] * 8} for _ in range(96)]
    header["__metadata__"]["arctic_rl"] = json.dumps(structure)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    bomb = len(text).to_bytes(8, "little") + text + bytes(body[8 + header_len :])
    error = refused(post(served["url"], "fwd_bwd", bomb, wire.MEDIA_TYPE), 400, "body")
    assert "add up to more than" in error["message"]
    assert state(client) == trained


# 8. Idempotency keys are bounded ----------------------------------------------------------------------


def test_oversized_request_ids_are_refused(served, client, trained):
    body = {"sequences": [s.model_dump() for s in grpo_batch(seed=9)], "loss": {"name": "grpo"}}
    refused(post(served["url"], "fwd_bwd", body, **{"X-Request-Id": "k" * (4 * 2**20)}), 400, "X-Request-Id")
    refused(post(served["url"], "fwd_bwd", body, **{"X-Request-Id": "k" * 129}), 400, "X-Request-Id")
    assert state(client) == trained
    assert post(served["url"], "fwd_bwd", body, **{"X-Request-Id": "k" * 128}).status_code == 200
    client.discard_gradients()


# 9. Cross-site requests to a loopback server without a token ---------------------------------------------


def test_without_a_token_only_loopback_hosts_and_origins_are_served(served):
    url = served["open_url"]
    client = ArcticRLClient(url, retries=0)
    before = state(client)
    refused(post(url, "shutdown", {}, token=None, Host="evil.example"), 403, "host")
    refused(post(url, "shutdown", {}, token=None, Origin="http://evil.example"), 403, "origin")
    refused(post(url, "shutdown", {}, token=None, Origin="null"), 403, "origin")
    refused(post(url, "step", b'{"learning_rate": 1.0}', content_type="", token=None), 415, "content-type")
    no_type = httpx.post(f"{url}/v1/step", content=b"{}")  # what a cross-site form or fetch could send
    assert no_type.status_code == 415
    assert client.health() == {"status": "ok"} and state(client) == before
    local = post(url, "weight_version", {}, token=None, Origin=url)  # a loopback page is fine
    assert local.status_code == 200


# 10. Slow clients are cut off ----------------------------------------------------------------------------


def test_slow_headers_and_stalled_bodies_are_cut_off(tiny_model):
    """Each deadline against a server of its own where it is short and the other is generous, so that neither
    cuts the other's probe. The sockets' 30 s timeouts only bound a hang: a probe not cut off fails on them."""
    config = BackendConfig(model_path=tiny_model, sampler=LIGHT_SAMPLER)
    settings = ServerSettings(port=free_loopback_port(), token=TOKEN, header_timeout_s=1.0, body_timeout_s=60.0)
    with ServerThread(settings, config) as url:
        with socket.create_connection((settings.host, settings.port), timeout=30) as idle:
            idle.sendall(b"POST /v1/fwd_bwd HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finish
            assert idle.recv(1024) == b""  # closed by the server, with no answer
        # Still serving. (A client's own headers are cut too if it stalls for a second before sending them:
        # a busy machine's client may, and retries.)
        assert ArcticRLClient(url, token=TOKEN, retries=5).health() == {"status": "ok"}
    settings = ServerSettings(port=free_loopback_port(), token=TOKEN, header_timeout_s=60.0, body_timeout_s=1.0)
    with ServerThread(settings, config) as url:
        with socket.create_connection((settings.host, settings.port), timeout=30) as stalled:
            stalled.sendall(f"POST /v1/fwd_bwd HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"seq".encode())
            reply = stalled.recv(4096).decode()
            assert reply.startswith("HTTP/1.1 408") and '"field":"body"' in reply.replace(" ", "")
        assert ArcticRLClient(url, token=TOKEN, retries=0).health() == {"status": "ok"}


def test_connections_beyond_the_cap_get_503_and_idle_ones_outlive_a_clients_keep_alive(tiny_model):
    """The cap counts open connections; an idle keep-alive connection is the server's to close only after the
    clients' own expiry (httpx's 5 s), so a client never writes a request into one the server is closing."""
    config = BackendConfig(model_path=tiny_model, sampler=LIGHT_SAMPLER)
    settings = ServerSettings(port=free_loopback_port(), token=TOKEN, max_connections=2)
    assert settings.keep_alive_s > httpx.Limits().keepalive_expiry
    with ServerThread(settings, config) as url:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(headers=auth) as first, httpx.Client(headers=auth) as second:
            assert first.get(f"{url}/v1/health").status_code == 200  # both stay open, idle
            assert second.get(f"{url}/v1/health").status_code == 200
            assert httpx.get(f"{url}/v1/health", headers=auth).status_code == 503
        assert httpx.get(f"{url}/v1/health", headers=auth).status_code == 200  # closed ones free their places
    settings = ServerSettings(port=free_loopback_port(), token=TOKEN, keep_alive_s=0.5)
    with ServerThread(settings, config) as url:
        with socket.create_connection((settings.host, settings.port), timeout=30) as idle:
            idle.sendall(f"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            assert idle.recv(4096).startswith(b"HTTP/1.1 200")
            assert idle.recv(1024) == b""  # closed by the server once idle for keep_alive_s


# 11. One error shape for unknown routes and wrong methods ---------------------------------------------------


def test_unknown_routes_and_wrong_methods_use_the_error_shape(served):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    missing = httpx.get(f"{served['url']}/v1/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "path"
    wrong = httpx.get(f"{served['url']}/v1/fwd_bwd", headers=auth)
    assert wrong.status_code == 405 and wrong.json()["error"]["field"] == "method"
