"""Several Tinker tenants on one base model: each trains exactly as it would alone, and none sees another's."""

from __future__ import annotations

import contextlib
import os
import threading

import httpx
import pytest
import torch

import tinker  # noqa: E402  (the `tinker` extra, which make install installs)
from tinker import types  # noqa: E402

from arctic_rl_core.client import ArcticRLClient  # noqa: E402
from arctic_rl_core.config import BackendConfig  # noqa: E402
from arctic_rl_core.engines.distributed import free_loopback_port  # noqa: E402
from arctic_rl_core.server.app import ServerSettings  # noqa: E402
from arctic_rl_core.server.run import ServerThread  # noqa: E402

from conftest import LIGHT_SAMPLER  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"
MODEL = "tiny/qwen3"
RANK = 8
ADAM = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
ENGINE = {"learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": None, "lora": {"r": RANK}}
TOKEN = "operator-token-0123456789"
KEYS = {"alice": "tml-alice-0123456789", "bob": "tml-bob-0123456789ab", "carol": "tml-carol-0123456789"}
STEPS = 3
SHAPES = {"alice": {"rank": RANK}, "bob": {"rank": 4}, "carol": {"rank": 2, "train_mlp": False}}
"""Each tenant's adapter: the job's, a smaller rank, a smaller rank on the attention modules only."""


def job(tiny_model, zero_stage: int = 2, adapters: int = 0) -> BackendConfig:
    return BackendConfig.model_validate({"model_path": tiny_model, "engine": {**ENGINE, "zero_stage": zero_stage},
                                         "sampler": {**LIGHT_SAMPLER, "adapters": adapters}})


@pytest.fixture(scope="module", params=[2, 0], ids=["zero2", "zero0"])
def shared(request, tiny_model, tmp_path_factory):
    """Three tenants' models at once, each tenant with its own key (and the operator's token for the rest); ZeRO-2
    keeps its optimizer state in flat partitions, ZeRO-0 in the optimizer's own."""
    settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL, token=TOKEN, tinker_tenants=3,
                              tinker_keys=KEYS, checkpoint_dir=str(tmp_path_factory.mktemp("checkpoints")))
    with ServerThread(settings, job(tiny_model, request.param, adapters=3)) as url:
        yield url


def data(tenant: str) -> list[types.Datum]:
    """Each tenant its own supervised rows (next-token datums, the first two targets unweighted)."""
    base = {"alice": 11, "bob": 40, "carol": 70}[tenant]
    rows = [[base + k for k in range(8)], [base, base + 3, base + 5, base + 2, base + 9, base + 1],
            [base + 7 - k for k in range(7)]]
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [0.0] * 2 + [1.0] * (len(r) - 3)})
            for r in rows]


def train(url: str, tenant: str, barrier: threading.Barrier | None = None) -> list[float]:
    """The tenant's loss at each step, then after the last one. With a barrier, every tenant's forward_backward
    runs before any tenant's optim_step: each tenant's gradients wait parked while the others train."""
    losses = []
    with tinker.ServiceClient(base_url=url, api_key=KEYS[tenant]) as service:
        tc = service.create_lora_training_client(base_model=MODEL, **SHAPES[tenant]).result()
        assert tc.get_info().lora_rank == SHAPES[tenant]["rank"]
        for _ in range(STEPS):
            losses.append(tc.forward_backward(data(tenant), "cross_entropy").result().metrics["loss:sum"])
            if barrier is not None:
                barrier.wait(timeout=120)
            tc.optim_step(ADAM).result()
            if barrier is not None:
                barrier.wait(timeout=120)
        losses.append(tc.forward(data(tenant), "cross_entropy").result().metrics["loss:sum"])
    return losses


def test_three_tenants_at_once_each_train_as_they_would_alone(shared, tiny_model, tmp_path):
    arctic = ArcticRLClient(shared, token=TOKEN, retries=0)
    digest = arctic.state_digest()
    alone = {tenant: train(shared, tenant) for tenant in KEYS}
    assert arctic.state_digest() == digest  # every tenant gone: the job's policy is as it was
    for curve in alone.values():
        assert curve[-1] < 0.97 * curve[0], curve  # each trains: its loss falls

    barrier = threading.Barrier(len(KEYS))
    together: dict[str, list[float]] = {}
    failures: list[BaseException] = []

    def run(tenant):
        try:
            together[tenant] = train(shared, tenant, barrier)
        except BaseException as err:  # reported below, and the others are not left waiting
            failures.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(tenant,)) for tenant in KEYS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for tenant in KEYS:
        assert together[tenant] == pytest.approx(alone[tenant], rel=1e-5), tenant
    assert arctic.state_digest() == digest

    # The same tenants alone on a server that trains one model at a time, on the job's policy itself.
    for tenant in ("alice", "bob"):
        settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL,
                                  checkpoint_dir=str(tmp_path / tenant))
        with ServerThread(settings, job(tiny_model)) as url:
            with tinker.ServiceClient(base_url=url, api_key="tml-anyone") as service:
                tc = service.create_lora_training_client(base_model=MODEL, **SHAPES[tenant]).result()
                plain = []
                for _ in range(STEPS):
                    plain.append(tc.forward_backward(data(tenant), "cross_entropy").result().metrics["loss:sum"])
                    tc.optim_step(ADAM).result()
                plain.append(tc.forward(data(tenant), "cross_entropy").result().metrics["loss:sum"])
        assert plain == pytest.approx(alone[tenant], rel=1e-5), tenant


def test_the_jobs_own_calls_see_its_policy_while_tenants_train(shared):
    arctic = ArcticRLClient(shared, token=TOKEN, retries=0)
    rows = [{"prompt_ids": [11, 12, 13], "response_ids": [14, 15, 16, 17]}]
    before, digest = arctic.log_probs(rows).logprobs, arctic.state_digest()
    with tinker.ServiceClient(base_url=shared, api_key=KEYS["alice"]) as service:
        tc = service.create_lora_training_client(base_model=MODEL, rank=RANK).result()
        for _ in range(2):
            tc.forward_backward(data("alice"), "cross_entropy").result()
            tc.optim_step(ADAM).result()
        tc.forward_backward(data("alice"), "cross_entropy").result()  # gradients left pending
        trained = tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"]
        # The training API's calls on the policy get the job's own, not alice's model the engine held...
        assert arctic.log_probs(rows).logprobs == before
        assert arctic.state_digest() == digest
        # ...and alice's model, pending gradients and all, is back for her next calls.
        assert tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"] == trained
        tc.optim_step(ADAM).result()
        assert tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"] < trained


def raw(url: str, key: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def test_a_tenant_cannot_see_or_touch_another_tenants_models(shared):
    alice, bob = KEYS["alice"], KEYS["bob"]
    with tinker.ServiceClient(base_url=shared, api_key=alice) as service:
        tc = service.create_lora_training_client(base_model=MODEL, rank=RANK).result()
        tc.forward_backward(data("alice"), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        state_path = tc.save_state("mine").result().path
        sampler_path = tc.save_weights_for_sampler("mine").result().path
        model_id = state_path.removeprefix("tinker://").split("/")[0]
        session_id = model_id.split(":")[0]
        # A future of alice's, made outside the SDK.
        own_session = raw(shared, alice, "create_session", {}).json()["session_id"]
        made = raw(shared, alice, "create_model", {"session_id": own_session, "model_seq_id": 0, "base_model": MODEL,
                                                   "lora_config": {"rank": RANK}}).json()
        before = tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"]
        # Her own state back from her checkpoint: the sampler, which other tenants share, is left as it was.
        tc.load_state_with_optimizer(state_path).result()
        assert tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"] == before
        assert ArcticRLClient(shared, token=TOKEN, retries=0).status()["backend"]["weight_version"] == 0

        digest = raw(shared, alice, "arctic/state_digest", {"model_id": model_id}).json()["digest"]
        bob_session = raw(shared, bob, "create_session", {}).json()["session_id"]
        assert raw(shared, bob, "arctic/state_digest", {"model_id": model_id}).status_code == 404
        refusals = {
            "get_info": raw(shared, bob, "get_info", {"model_id": model_id}),
            "optim_step": raw(shared, bob, "optim_step", {"model_id": model_id, "seq_id": 50,
                                                          "adam_params": {"learning_rate": 1.0}}),
            "save_weights": raw(shared, bob, "save_weights", {"model_id": model_id, "seq_id": 51, "path": "x"}),
            "weights_info": raw(shared, bob, "weights_info", {"tinker_path": state_path}),
            "load_weights": raw(shared, bob, "load_weights", {"session_id": bob_session, "model_seq_id": 0,
                                                              "path": state_path, "optimizer": True}),
            "create_sampling_session": raw(shared, bob, "create_sampling_session",
                                           {"session_id": bob_session, "model_path": sampler_path}),
            "retrieve_future": raw(shared, bob, "retrieve_future", {"request_id": made["request_id"]}),
            "finish": raw(shared, bob, f"sessions/{session_id}/finish", {}),
        }
        for route, answer in refusals.items():
            assert answer.status_code == 404, (route, answer.text)
            assert "alice" not in answer.text
        assert raw(shared, bob, "session_heartbeat", {"session_id": session_id}).status_code == 410
        # Nothing of alice's moved: her model trains on from where it was, and her future is hers to read.
        assert raw(shared, alice, "arctic/state_digest", {"model_id": model_id}).json()["digest"] == digest
        assert tc.forward(data("alice"), "cross_entropy").result().metrics["loss:sum"] == before
        assert raw(shared, alice, "retrieve_future", {"request_id": made["request_id"]}).json()["model_id"] == \
            made["model_id"]
        assert raw(shared, alice, f"sessions/{own_session}/finish", {}).status_code == 200
        assert raw(shared, bob, f"sessions/{bob_session}/finish", {}).status_code == 200
        # Her sampler samples her weights: its log-probs are her trainer's.
        sampling = service.create_sampling_client(model_path=sampler_path)
        prompt = types.ModelInput.from_ints([11, 12, 13, 14])
        sample = sampling.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=1.0)).result()
        trainer = scored(tc, [11, 12, 13, 14], sample.sequences[0].tokens)
        assert trainer == pytest.approx(sample.sequences[0].logprobs, abs=1e-4)


def scored(tc, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's log-probs of `tokens` after `prompt`, through the tenant's own training client."""
    full = prompt + tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    return list(tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()[-len(tokens):])


def test_each_tenant_samples_its_own_adapter_while_the_others_hold_theirs(shared):
    prompt = [11, 12, 13, 14]
    with contextlib.ExitStack() as stack:
        trainers, samplers = {}, {}
        for tenant in KEYS:  # every tenant trains a step on its own data and saves for the sampler
            service = stack.enter_context(tinker.ServiceClient(base_url=shared, api_key=KEYS[tenant]))
            trainers[tenant] = service.create_lora_training_client(base_model=MODEL, **SHAPES[tenant]).result()
            trainers[tenant].forward_backward(data(tenant), "cross_entropy").result()
            trainers[tenant].optim_step(ADAM).result()
            samplers[tenant] = trainers[tenant].save_weights_and_get_sampling_client()
        # All three saved: each samples its own weights, none refused as replaced.
        futures = {tenant: samplers[tenant].sample(types.ModelInput.from_ints(prompt), 1,
                                                   types.SamplingParams(max_tokens=6, temperature=1.0))
                   for tenant in KEYS}
        samples = {tenant: future.result().sequences[0] for tenant, future in futures.items()}
        for tenant, sample in samples.items():
            assert scored(trainers[tenant], prompt, sample.tokens) == pytest.approx(sample.logprobs, abs=1e-4), tenant
        # ...and its own are not another's: the same tokens weigh otherwise under bob's adapter.
        alice = samples["alice"]
        assert max(abs(a - b) for a, b in zip(scored(trainers["bob"], prompt, alice.tokens), alice.logprobs)) > 1e-3
    # The sampler kept the base model: the adapters sampled on it, nothing was synced.
    assert ArcticRLClient(shared, token=TOKEN, retries=0).status()["backend"]["weight_version"] == 0


@pytest.mark.parametrize("zero_stage", [2, 0], ids=["zero2", "zero0"])
def test_a_smaller_adapter_trains_as_that_adapter_would_on_its_own(tiny_model, tmp_path, zero_stage):
    """Carol's model (rank 2, attention only) on the job's rank-8 adapter is a rank-2 LoRA: the adapter saved for
    the sampler is one, and PEFT training that adapter from her first save with AdamW on the same data (a plain
    loop, no engine) takes the same losses to the same weights."""
    import peft
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    settings = ServerSettings(port=free_loopback_port(), served_model_name=MODEL, tinker_tenants=2,
                              checkpoint_dir=str(tmp_path))
    with ServerThread(settings, job(tiny_model, zero_stage, adapters=2)) as url:
        with tinker.ServiceClient(base_url=url, api_key="tml-carol") as service:
            tc = service.create_lora_training_client(base_model=MODEL, **SHAPES["carol"]).result()
            tc.save_weights_for_sampler("start").result()
            losses = []
            for _ in range(STEPS):
                losses.append(tc.forward_backward(data("carol"), "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(ADAM).result()
            tc.save_weights_for_sampler("end").result()
    # Each save of an adapter is a folder of its own, numbered in order.
    start, end = sorted(tmp_path.glob("tinker/*/*/sampler_weights/a*"), key=lambda p: int(p.name[1:]))

    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), start,
                                               is_trainable=True)
    config = reference.peft_config["default"]
    assert config.r == 2 and config.target_modules and not any("mlp" in m for m in config.target_modules)
    assert all(".self_attn." in name for name, _ in reference.named_parameters() if "lora_" in name)
    trained = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                  weight_decay=0.0)
    expected = []
    for _ in range(STEPS):
        loss = torch.zeros(())
        for datum in data("carol"):
            tokens = torch.tensor([datum.model_input.to_ints()])
            logprobs = reference(tokens).logits.float().log_softmax(-1)[0]
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy()).long()
            weights = torch.tensor(datum.loss_fn_inputs["weights"].to_numpy())
            loss = loss - (logprobs.gather(-1, targets[:, None])[:, 0] * weights).sum()
        expected.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses == pytest.approx(expected, rel=1e-5)
    saved = load_file(str(end / "adapter_model.safetensors"))
    ours = {name.replace(".default", ""): p.detach() for name, p in reference.named_parameters() if p.requires_grad}
    assert sorted(saved) == sorted(ours)
    for name, tensor in saved.items():
        assert tensor.shape == ours[name].shape and tensor.shape[0 if ".lora_A." in name else 1] == 2
        torch.testing.assert_close(tensor, ours[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_checkpoint_keeps_its_adapters_shape_and_a_shape_the_job_cannot_train_is_refused(shared):
    with tinker.ServiceClient(base_url=shared, api_key=KEYS["carol"]) as service:
        tc = service.create_lora_training_client(base_model=MODEL, **SHAPES["carol"]).result()
        tc.forward_backward(data("carol"), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        path = tc.save_state("shaped").result().path
        loss = tc.forward(data("carol"), "cross_entropy").result().metrics["loss:sum"]
        assert service.create_rest_client().get_weights_info_by_tinker_path(path).result().lora_rank == 2
        # Made from the checkpoint, a model trains the checkpoint's shape, from where it was.
        again = service.create_training_client_from_state_with_optimizer(path)
        assert again.get_info().lora_rank == 2
        assert again.forward(data("carol"), "cross_entropy").result().metrics["loss:sum"] == loss
    with tinker.ServiceClient(base_url=shared, api_key=KEYS["carol"]) as service:
        other = service.create_lora_training_client(base_model=MODEL, rank=RANK).result()
        with pytest.raises(tinker.BadRequestError, match="path.*rank 2.*this model trains rank 8"):
            other.load_state_with_optimizer(path).result()
        for shape, field in [({"rank": RANK + 1}, "lora_config.rank"), ({"rank": 0}, "lora_config.rank"),
                             ({"rank": 4, "seed": 7}, "lora_config.seed"),
                             ({"rank": 4, "train_attn": False, "train_mlp": False}, "lora_config")]:
            with pytest.raises(tinker.BadRequestError, match=field):
                service.create_lora_training_client(base_model=MODEL, **shape).result()


def test_a_models_oldest_adapters_stop_being_served_and_say_so(shared):
    from arctic_rl_core.tinker.routes import KEPT_PER_MODEL

    prompt = types.ModelInput.from_ints([11, 12, 13])
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    with tinker.ServiceClient(base_url=shared, api_key=KEYS["carol"]) as service:
        tc = service.create_lora_training_client(base_model=MODEL, rank=RANK).result()
        samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(KEPT_PER_MODEL + 1)]
        with pytest.raises(tinker.BadRequestError, match="sampling_session_id.*no longer kept"):
            samplers[0].sample(prompt, 1, params).result()
        for sampler in samplers[1:]:
            assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2


def test_keys_are_the_tenants_and_open_only_the_tinker_routes(shared):
    with pytest.raises(tinker.AuthenticationError):
        with tinker.ServiceClient(base_url=shared, api_key="tml-nobody-0123456789") as service:
            service.create_lora_training_client(base_model=MODEL, rank=RANK).result()
    # A tenant's key is no token for the training API; the operator's token is.
    assert httpx.get(f"{shared}/v1/status", headers={"X-API-Key": KEYS["bob"]}).status_code == 401
    assert httpx.get(f"{shared}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("content, field", [
    ('["tml-0123456789abcdef"]', "tinker_keys"),
    ('{"alice": "short"}', "tinker_keys.alice"),
    ('{"job": "tml-0123456789abcdef"}', "tinker_keys.job"),
    ('{"a/b": "tml-0123456789abcdef"}', "tinker_keys.a/b"),
    ('{"..": "tml-0123456789abcdef"}', "tinker_keys..."),
    ('{"a": "tml-0123456789abcdef", "b": "tml-0123456789abcdef"}', "tinker_keys"),
    ("{not json", "tinker_keys"),
])
def test_a_keys_file_is_refused_by_field(tmp_path, content, field):
    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.tinker.tenants import read_keys

    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest) as refused:
        read_keys(str(path))
    assert refused.value.field == field


def test_one_tenants_flood_of_sessions_pushes_out_only_its_own(shared, monkeypatch):
    from arctic_rl_core.tinker import routes

    # The server runs in this process: smaller caps, read when a session is made, keep the flood short.
    monkeypatch.setattr(routes, "SESSIONS_PER_TENANT", 4)
    monkeypatch.setattr(routes, "SAMPLERS_PER_TENANT", 4)
    SESSIONS_PER_TENANT, SAMPLERS_PER_TENANT = 4, 4

    def sampler(key, session_id):
        return raw(shared, key, "create_sampling_session",
                   {"session_id": session_id, "base_model": MODEL}).json()["sampling_session_id"]

    def served(key, sampler_id):
        return httpx.get(f"{shared}/api/v1/samplers/{sampler_id}", headers={"X-API-Key": key}).status_code == 200

    alice = raw(shared, KEYS["alice"], "create_session", {}).json()["session_id"]
    bob = raw(shared, KEYS["bob"], "create_session", {}).json()["session_id"]
    alices = sampler(KEYS["alice"], alice)
    bobs = [sampler(KEYS["bob"], bob) for _ in range(SAMPLERS_PER_TENANT + 1)]
    assert not served(KEYS["bob"], bobs[0]) and served(KEYS["bob"], bobs[-1]) and served(KEYS["alice"], alices)
    assert raw(shared, KEYS["bob"], f"sessions/{bob}/finish", {}).status_code == 200
    flood = [raw(shared, KEYS["bob"], "create_session", {}).json()["session_id"]
             for _ in range(SESSIONS_PER_TENANT + 1)]
    assert raw(shared, KEYS["bob"], "session_heartbeat", {"session_id": flood[0]}).status_code == 410
    assert raw(shared, KEYS["bob"], "session_heartbeat", {"session_id": flood[-1]}).status_code == 200
    assert raw(shared, KEYS["alice"], "session_heartbeat", {"session_id": alice}).status_code == 200
    for session_id in flood[1:] + [alice]:
        key = KEYS["alice"] if session_id == alice else KEYS["bob"]
        assert raw(shared, key, f"sessions/{session_id}/finish", {}).status_code == 200


def test_one_tenants_flood_of_requests_neither_blocks_nor_forgets_anothers():
    import asyncio

    from arctic_rl_core.errors import NotFound
    from arctic_rl_core.server.limits import OverLimit
    from arctic_rl_core.tinker.futures import FutureTable

    async def run():
        table = FutureTable(poll_s=0.01, per_tenant_pending=3, per_tenant_done=2)
        kept, kept_future = table.add(lambda r: r, "alice")
        kept_future.set_result("alice's")
        waiting = [table.add(lambda r: r, "bob") for _ in range(3)]
        with pytest.raises(OverLimit, match="this tenant's"):
            table.add(lambda r: r, "bob")
        table.add(lambda r: r, "alice")  # bob's cap is his own
        for _, future in waiting:
            future.set_result("bob's")
        for _ in range(5):  # bob's results beyond his cap push out his own oldest, not alice's
            table.add(lambda r: r, "bob")[1].set_result("bob's")
        assert await table.retrieve(kept, "alice") == ("done", "alice's")
        with pytest.raises(NotFound):
            await table.retrieve(waiting[0][0], "bob")

    asyncio.run(run())


def test_a_tenants_exported_adapter_downloads_and_loads_in_peft_with_the_trainers_log_probs(shared, tiny_model,
                                                                                            tmp_path):
    """A LoRA model's external weights are its PEFT adapter, in the shape it trained (bob's: rank 4): downloaded
    through the signed URLs, on the base model in peft it scores as the trainer does; another tenant gets no URL."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tinker.ServiceClient(base_url=shared, api_key=KEYS["bob"]) as service:
        tc = service.create_lora_training_client(base_model=MODEL, **SHAPES["bob"]).result()
        tc.forward_backward(data("bob"), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        path = tc.save_weights_external("bob-adapter").result().path
        trainer = [out["logprobs"].to_torch() for out in tc.forward(data("bob"), "cross_entropy").result().loss_fn_outputs]
        urls = service.create_rest_client().get_external_weights_urls(path).result().urls
    with tinker.ServiceClient(base_url=shared, api_key=KEYS["alice"]) as service:
        with pytest.raises(tinker.NotFoundError):
            service.create_rest_client().get_external_weights_urls(path).result()
    assert "adapter_config.json" in urls
    for name, url in urls.items():
        (tmp_path / name).write_bytes(httpx.get(url).raise_for_status().content)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32),
                                      tmp_path).eval()
    assert model.peft_config["default"].r == SHAPES["bob"]["rank"]
    for d, expected in zip(data("bob"), trainer):
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data)
        with torch.no_grad():
            logits = model(torch.tensor([d.model_input.to_ints()])).logits[0].float()
        scored = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(scored, expected.float(), rtol=1e-5, atol=1e-5)
