"""The trainer process prime-rl's orchestrator talks to, training through an Arctic RL server.

prime-rl has no seam for another trainer, but its orchestrator meets the trainer at two
boundaries only: the batches it sends (`rollout_transport`) and the weights it waits for
(`{output_dir}/broadcasts/step_n/STABLE`). This process sits at both, reading prime-rl's own
trainer config (`TrainerConfig`, the same TOML and flags as `trainer @ trainer.toml`):

  v0 published  ->  for step n = 1, 2, ...: receive rank 0's micro-batches of step n,
  unpack them into sequences grouped by prompt, fwd_bwd with prime-rl's loss, step,
  sync the server's sampler, publish step n (`STABLE`).

The orchestrator samples from the same server (its `client.base_url`), whose sampler now
holds the new weights before `STABLE` appears; the orchestrator's `POST /update_weights`
then finds them there. Its own backpressure (`TARGET_LAG`, `max_off_policy_steps`) works
unchanged, since it reads only the published steps.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from arctic_rl_core import attach
from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.types import LossSpec
from arctic_rl_primerl.batches import StepBatch, step_batch
from arctic_rl_primerl.transport import Receiver, receiver_for

log = logging.getLogger("arctic_rl_primerl")

LOSSES = {"default": "primerl_default", "ipo": "primerl_ipo"}
OPTIMIZER_NAMES = {"weight_decay": "weight_decay", "betas": "betas1/betas2", "grad_clip": "max_norm"}
KEYS = attach.Keys(url="--arctic-rl-url", model="model.name", optimizer="optim", framework="prime-rl")


@dataclass
class Settings:
    """The adapter's own options (not prime-rl's): where the Arctic RL server is."""

    url: str
    token_env: str = "ARCTIC_RL_TOKEN"
    timeout_s: float = 600.0


def refusals(config) -> list[tuple[str, str]]:
    """What of prime-rl's trainer config this trainer does not do, by field, before the first step."""
    out = []
    if config.loss.type not in LOSSES:
        out.append(("loss.type", f"{config.loss.type!r}: a custom prime-rl loss runs on prime-rl's own tensors; "
                                 "register it as an Arctic RL loss plugin (docs/losses.md) and use default or ipo here"))
    if config.optim.type != "adamw":
        out.append(("optim.type", f"{config.optim.type!r}: the Arctic RL engine runs AdamW"))
    if config.scheduler.type != "constant":
        out.append(("scheduler.type", f"{config.scheduler.type!r}: only a constant learning rate is supported"))
    if config.weight_broadcast.type != "filesystem":
        out.append(("weight_broadcast.type", f"{config.weight_broadcast.type!r}: the weights reach the sampler through "
                                             "the Arctic RL server; only the filesystem STABLE markers are published"))
    if config.model.lora is not None:
        out.append(("model.lora", "LoRA training is not supported: the Arctic RL job trains every parameter"))
    if config.model.vlm is not None:
        out.append(("model.vlm", "multimodal models are not supported"))
    if config.ckpt is not None or config.resume is not None:
        field = "ckpt" if config.ckpt is not None else "resume"
        out.append((field, "checkpoints are the Arctic RL server's (POST /v1/checkpoints/save): leave it unset"))
    if config.data.fake is not None:
        out.append(("data.fake", "fake batches are prime-rl's trainer's debugging mode"))
    return out


def check(config) -> None:
    refused = refusals(config)
    if refused:
        raise ArcticSetupError("; ".join(f"{field}: {why}" for field, why in refused))


def connect(config, settings: Settings) -> tuple[ArcticRLClient, int]:
    """A client of the server, whose job trains `model.name` with prime-rl's AdamW settings; and the vocabulary."""
    from transformers import AutoConfig

    client, status = attach.reach(settings.url, settings.token_env, settings.timeout_s, KEYS)
    optim = config.optim
    ours = attach.optimizer_settings(optim.weight_decay, (optim.betas1, optim.betas2), optim.max_norm)
    job = {"model_path": config.model.name, "engine": {"learning_rate": optim.lr, **ours},
           **({"router_replay": "R3"} if config.enable_router_replay else {})}
    status = attach.start_or_get_job(client, status, job)
    if config.enable_router_replay and status["backend"].get("router_replay", "off") == "off":
        raise ArcticSetupError("enable_router_replay: the Arctic RL job replays no routing; start the server's job with "
                               "router_replay: R3 (and a sampler that records it)")
    hf_config = AutoConfig.from_pretrained(config.model.name, trust_remote_code=config.model.trust_remote_code)
    attach.check_model(config.model.name, hf_config.to_dict(), status, KEYS)
    attach.check_optimizer(ours, status, OPTIMIZER_NAMES, KEYS)
    return client, int(status["backend"]["model"]["vocab_size"])


def loss_specs(config, batch: StepBatch) -> list[tuple[list, LossSpec]]:
    """One fwd_bwd per sampling temperature. prime-rl divides the step's summed token losses by the step's trained
    tokens; each call's loss is a token mean over its own, so each call's coefficients carry its share."""
    loss = config.loss.model_dump(exclude={"type"})
    total = batch.num_tokens
    calls = []
    for temperature, sequences in sorted(batch.by_temperature.items()):
        share = sum(int(sum(s.loss_mask)) for s in sequences) / total
        scaled = {**loss, "adv_tau": loss["adv_tau"] * share, "kl_tau": loss["kl_tau"] * share}
        post = [] if temperature == 1.0 else [{"name": "apply_temperature", "config": {"temperature": temperature}}]
        calls.append((sequences, LossSpec(name=LOSSES[config.loss.type], config=scaled, post=post)))
    return calls


def publish(output_dir: Path, step: int, weight_version: int) -> Path:
    """`broadcasts/step_{step}/STABLE`: the orchestrator's signal that policy v{step} is being served. The weights
    themselves are already in the server's sampler; the record says which version they are."""
    folder = output_dir / "broadcasts" / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arctic_rl.json").write_text(json.dumps({"step": step, "weight_version": weight_version}))
    (folder / "STABLE").touch()
    return folder


def train_step(client: ArcticRLClient, config, batch: StepBatch) -> dict:
    started = time.perf_counter()
    loss = computed = 0.0
    metrics: dict[str, float] = {}
    for sequences, spec in loss_specs(config, batch):
        result = client.fwd_bwd(sequences, spec)
        loss += result.loss
        computed += result.computed_tokens
        for name, value in result.metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value * sum(int(sum(s.loss_mask)) for s in sequences) / batch.num_tokens
    trained = time.perf_counter()
    stepped = client.step()
    version = client.sync_weights()
    replayed = sum(s.routed_experts is not None for seqs in batch.by_temperature.values() for s in seqs)
    return {"loss": loss, "samples": batch.samples, "replayed_samples": replayed, "trained_tokens": batch.num_tokens,
            "computed_tokens": int(computed), "unshared_tokens": batch.unshared_tokens,
            "fwd_bwd_s": trained - started, "step_sync_s": time.perf_counter() - trained, "grad_norm": stepped.grad_norm,
            "weight_version": version, **{f"loss/{k}": v for k, v in metrics.items()}}


def run(config, settings: Settings, stop: threading.Event | None = None,
        receiver: Receiver | None = None) -> int:
    """Train until `max_steps` (or until `stop` is set); return the last step trained."""
    check(config)
    stop = stop or threading.Event()
    output_dir = Path(config.output_dir)
    client, vocab_size = connect(config, settings)
    receiver = receiver or receiver_for(config.rollout_transport, output_dir)
    step = 1
    try:
        publish(output_dir, 0, client.weight_version)
        log.info("published v0 (weight version %d); waiting for step 1's batch", client.weight_version)
        while config.max_steps is None or step <= config.max_steps:
            waited = time.perf_counter()
            micro_batches = receiver.receive(step, stop.is_set)
            if micro_batches is None:
                break
            batch = step_batch(micro_batches, vocab_size, replay=config.enable_router_replay)
            if not batch.samples:
                raise ArcticSetupError(f"step {step}: the orchestrator's batch holds no trainable token")
            record = {"step": step, "wait_s": time.perf_counter() - waited, **train_step(client, config, batch)}
            publish(output_dir, step, record["weight_version"])
            log.info("step %d %s", step, json.dumps(record))
            _append(output_dir / "arctic_rl_trainer.jsonl", record)
            step += 1
    finally:
        receiver.close()
    return step - 1


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    """`arctic-rl-primerl-trainer --arctic-rl-url URL @ trainer.toml [prime-rl trainer flags]`."""
    import argparse
    import sys

    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.utils.config import cli

    parser = argparse.ArgumentParser(prog="arctic-rl-primerl-trainer", add_help=False)
    parser.add_argument("--arctic-rl-url", required=True, help="the Arctic RL server (`arctic-rl serve`)")
    parser.add_argument("--arctic-rl-token-env", default="ARCTIC_RL_TOKEN")
    parser.add_argument("--arctic-rl-timeout-s", type=float, default=600.0)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    config = cli(TrainerConfig, args=rest)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s arctic-rl-primerl %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run(config, Settings(ours.arctic_rl_url, ours.arctic_rl_token_env, ours.arctic_rl_timeout_s), stop)
    except ArcticSetupError as err:
        raise SystemExit(f"arctic-rl-primerl-trainer: {err}") from None
