"""`InProcessBackend`: the training API on an engine and a sampler in this process.

Every request is validated in full before the engine is touched, so a bad
request leaves weights, optimizer state and accumulated gradients as they were.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from contextlib import contextmanager, nullcontext
from functools import cached_property
from typing import Any

import numpy as np
from safetensors.torch import load_file, save_file

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.batching import build_micro_batches, refuse_unread, require_fields, validate_sequences
from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.errors import ArcticRLError, InvalidRequest
from arctic_rl_core.locks import SharedLock
from arctic_rl_core.samplers import engine_placement
from arctic_rl_core.validation import parse
from arctic_rl_core.types import (
    AdamSettings,
    CheckpointInfo,
    Completion,
    Episode,
    EpisodeRequest,
    FwdBwdResult,
    GenerateRequest,
    LogProbsResult,
    LossSpec,
    ProcessorSpec,
    RoutedExperts,
    SamplingParams,
    Sequence,
    MAX_LEARNING_RATE,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    StepResult,
    ValuesResult,
    model_shape,
    token_list,
)
from arctic_rl_core.plugins.manager import PluginManager, load_plugins
from arctic_rl_core.models.fingerprint import checkpoint_fingerprint
from arctic_rl_core.models.lora_shape import AdapterLayout, AdapterShape
from arctic_rl_core.models.router_replay import check_record
from arctic_rl_core.trajectories import TrajectoryStore


CRITIC_DIR = "critic"
"""Where a checkpoint of a job with a critic holds the critic's state."""
SAMPLER_RANDOM_STATE = "sampler_random_state.safetensors"
"""Where a checkpoint holds the sampler's generators (`Sampler.random_state`)."""


def _split(count: int, micro_batches, outputs, key: str) -> list[list[float]]:
    """Per-token output `key` of micro-batches, per sequence in the caller's order."""
    rows: list[list[float]] = [[] for _ in range(count)]
    for mb, out in zip(micro_batches, outputs):
        offset = 0
        for seq_id, length in zip(mb.sequence_ids, mb.response_lengths):
            rows[seq_id] = out[key][offset : offset + length].tolist()
            offset += length
    return rows


def _per_sequence(count: int, micro_batches, outputs, with_entropy: bool):
    """Per-token outputs of micro-batches, per sequence in the caller's order: (log-probs, entropy or None)."""
    return (_split(count, micro_batches, outputs, "logprobs"),
            _split(count, micro_batches, outputs, "entropy") if with_entropy else None)


def _routes_taken(count: int, micro_batches, outputs) -> list[RoutedExperts] | None:
    """Per sequence, the routing a router-replaying forward took at each of its tokens; None without replay."""
    if not outputs or "routed_experts" not in outputs[0]:
        return None
    routes: list[RoutedExperts | None] = [None] * count
    for mb, out in zip(micro_batches, outputs):
        for j, seq_id in enumerate(mb.sequence_ids):
            routes[seq_id] = RoutedExperts.of(out["routed_experts"][mb.token_rows(j)].numpy())
    return routes


def parse_sequences(sequences: Any, field: str = "sequences") -> list[Sequence]:
    if not isinstance(sequences, list):
        raise InvalidRequest(field, "must be a list of sequences")
    return [parse(Sequence, s, f"{field}[{i}]") for i, s in enumerate(sequences)]


class InProcessBackend(TrainingAPI):
    def __init__(self, config: BackendConfig | dict, plugins: PluginManager | None = None, served: bool = False):
        """`served`: the job runs under a server (`arctic-rl serve`), which decides `sampler.placement: auto`."""
        self.config = engine_placement.resolved(parse(BackendConfig, config, "config"), served)
        self.plugins = plugins = plugins if plugins is not None else load_plugins()
        """Where this backend finds its losses, post-processors, engine and sampler."""
        engine_factory = plugins.engine_factory(self.config.engine.name)
        sampler_factory = plugins.sampler_factory(self.config.sampler.name)
        self.engine = engine_factory(self.config)
        try:
            if self.config.sampler.replicas > 1:
                from arctic_rl_core.samplers.sampler_pool import SamplerPool

                self.sampler = SamplerPool(self.config)
            else:
                self.sampler = sampler_factory(self.config)
        except BaseException:
            self._close(self.engine)
            raise
        self.reference = self.critic = None
        try:
            if self.config.reference.enable:
                from arctic_rl_core.engines.reference import ReferenceModel

                self.reference = ReferenceModel(self.config)
            if self.config.critic.enable:
                from arctic_rl_core.engines.critic import CriticEngine

                self.critic = CriticEngine(self.config)
        except BaseException:
            self.close()
            raise
        self._reference_lock = threading.Lock()
        self._critic_lock = threading.Lock()
        """Held by every call on the critic (it has no sampler, and trains apart from the policy)."""
        self._critic_accumulated: list[tuple] = []
        self._weight_version = 0
        self._synced_step = 0
        """Optimizer step count of the weights the sampler holds."""
        # Training calls are applied one at a time, in order.
        self._train_lock = threading.Lock()
        # Held by whatever writes the trainer's weights (step, load) and by log_probs, which reads them.
        self._weights_lock = threading.Lock()
        # generate and sync_weights share the sampler's copy of the weights. A sampler pool takes concurrent
        # generate calls (each replica queues its own work); everything else has the sampler to itself.
        self._sampler_lock = SharedLock()
        self._accumulated: list[tuple] = []
        """The fwd_bwd calls whose gradients are pending: replayed to restore them if a later call fails."""
        self._counters_lock = threading.Lock()
        self.generated = {"calls": 0, "completions": 0, "tokens": 0}
        """What the sampler produced so far (served by the server's status route)."""
        self.trajectories = TrajectoryStore(self.config.sampler.capture_tokens)
        self.learning_rate: float | None = None
        """Of the last step (status reports it: a framework's schedule can be seen reaching the job)."""
        self._aborts = 0
        """`abort_generation` calls so far: a generate call that waited for the sampler through one is aborted."""
        self._adapters: set[str] = set()
        """The LoRA adapters the sampler serves (`add_adapter`)."""
        self._adapter_layout: AdapterLayout | None = None

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # -- validation --------------------------------------------------------------------------------

    def _validated(self, sequences: Any) -> list[Sequence]:
        seqs = parse_sequences(sequences)
        validate_sequences(seqs, max_context=self.engine.max_context, vocab_size=self.engine.vocab_size)
        replay = getattr(self.engine, "replay_shape", None)
        for i, seq in enumerate(seqs):
            if seq.routed_experts is None:
                continue
            where = f"sequences[{i}].routed_experts"
            if replay is None:
                raise InvalidRequest(where, "would be ignored: this job replays no routing (router_replay is "
                                            f"{self.config.router_replay!r}, or the model is dense)")
            check_record(seq.routed_experts.array(), replay, where)
        return seqs

    def _sampler_in_use(self):
        """Held by work that samples or scores: shared where the sampler takes concurrent calls, alone otherwise
        (a sync waits for it, or takes it shared where the sampler crosses syncs)."""
        return self._sampler_lock.shared() if self.sampler.concurrent_generate else self._sampler_lock

    @contextmanager
    def _sampler_asleep(self):
        """With sampler.sleep_during_training, the sampler's KV cache is released while training runs."""
        if not self.config.sampler.sleep_during_training:
            yield
            return
        with self._sampler_lock:
            self.sampler.sleep()
            try:
                yield
            finally:
                self.sampler.wake_up()

    def _micro_batches(self, seqs: list[Sequence]):
        # The one ZoRRo switch: `config.zorro.enable`, read here at every call (a benchmark may flip it between
        # calls). The engine loads ZoRRo's attention wherever the family allows, so either way the numbers are
        # the model's; a family ZoRRo cannot serve runs its own attention, which cannot take a packed forest.
        zorro = self.config.zorro
        if zorro.enable and not getattr(self.engine, "zorro_loaded", False):
            raise InvalidRequest("zorro.enable", "this model runs its own attention: ZoRRo cannot serve its family "
                                                 "(load it with zorro.enable=true for the reason)")
        return build_micro_batches(
            seqs, token_budget=self.config.engine.micro_batch_tokens, weight_version=self._weight_version,
            pad_id=self.engine.pad_token_id, forest=zorro.enable, min_shared_tokens=zorro.min_shared_tokens,
        )

    def _post_chain(self, post: list[ProcessorSpec]) -> list[tuple[Any, Any]]:
        chain = []
        for i, spec in enumerate(post):
            entry = self.plugins.post_processors.get(spec.name, f"loss.post[{i}].name")
            chain.append((entry, entry.parse_config(spec.config, f"loss.post[{i}].config")))
        return chain

    # -- the API -------------------------------------------------------------------------------------

    def checked_generate(self, prompts, sampling=None, session: str | None = None) -> GenerateRequest:
        """A generate request parsed and checked against the model (vocabulary, context), or `InvalidRequest`."""
        request = parse(GenerateRequest, {"prompts": prompts, "sampling": sampling, "session": session}, "")
        prompts, params = request.prompts, request.sampling
        if not prompts:
            raise InvalidRequest("prompts", "must hold at least one prompt")
        vocab = self.engine.vocab_size
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if not ids.size:
                raise InvalidRequest(f"prompts[{i}]", "must be a non-empty list of token ids")
            if ids.min() < 0 or ids.max() >= vocab:
                raise InvalidRequest(f"prompts[{i}]", f"token ids must be integers in [0, {vocab})")
            if params.prompt_logprobs is not None and len(prompt) < 2:
                raise InvalidRequest(f"prompts[{i}]", "prompt_logprobs needs a prompt of at least 2 tokens")
            if len(prompt) + params.max_tokens > self.sampler.max_context:
                raise InvalidRequest(
                    f"prompts[{i}]",
                    f"{len(prompt)} tokens + max_tokens {params.max_tokens} exceed the sampler's context {self.sampler.max_context}",
                )
        reshaped = params.reshaped_by()
        if (reshaped and params.logprobs_of == "model" and params.temperature not in (0.0, 1.0)
                and not self.sampler.exact_reshaped_logprobs):
            raise InvalidRequest(f"sampling.{reshaped}", f"the {self.config.sampler.name} sampler's log-probs under "
                                 f"{reshaped} at temperature {params.temperature} are not the model's own: sample at "
                                 "temperature 1, or ask for the sampled distribution's (sampling.logprobs_of: sampler)")
        unsupported = next((name for name in self.sampler.unsupported_sampling
                            if getattr(params, name) != SamplingParams.model_fields[name].get_default(
                                call_default_factory=True)), None)
        if unsupported:
            raise InvalidRequest(f"sampling.{unsupported}", f"the {self.config.sampler.name} sampler cannot apply it")
        if params.adapter is not None:
            if params.adapter not in self._adapters:
                raise InvalidRequest("sampling.adapter", f"no adapter {params.adapter!r} is served")
            if self._weight_version != 0:
                raise InvalidRequest("sampling.adapter", f"the sampler holds weights synced from the trainer (version "
                                     f"{self._weight_version}), not the base model its adapters apply to")
            scored = "prompt_logprobs" if params.prompt_logprobs is not None else \
                reshaped if reshaped and params.logprobs_of == "model" else None
            if scored and not self.sampler.scores_under_adapters:
                raise InvalidRequest(f"sampling.{scored}", f"the {self.config.sampler.name} sampler cannot score "
                                     "prompts under an adapter" + ("" if scored == "prompt_logprobs" else
                                                                   ": ask for logprobs_of: sampler"))
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids)):
            bad = next((t for t in ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(f"sampling.{name}", f"token id {bad} is outside the vocabulary ({vocab})")
        return request

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | dict | None = None,
                 session: str | None = None, on_tokens=None, cancel: Cancellation | None = None) -> list[Completion]:
        """`on_tokens(prompt index, sample index, token ids, log-probs, top log-probs, ranks)`: a sampler that streams
        tokens calls it with each engine step's new tokens; another sampler does not call it. `cancel`: once
        cancelled (a client that went away), a sampler that can (`cancels_calls`) ends this call's requests at its
        next step, and the call returns what they sampled so far; another runs it to its end."""
        request = self.checked_generate(prompts, sampling, session)
        prompts, params = request.prompts, request.sampling
        epoch = self._aborts
        with self._sampler_in_use():
            if self._aborts != epoch or cancel is not None and cancel.cancelled:  # while it waited for the sampler
                completions = [Completion(prompt_index=i, token_ids=[], logprobs=[], finish_reason="abort",
                                          weight_version=self._weight_version)
                               for i in range(len(prompts)) for _ in range(params.n)]
            else:
                extra = {"on_tokens": on_tokens} if on_tokens is not None and self.sampler.streams_tokens else {}
                if cancel is not None and self.sampler.cancels_calls:
                    extra["cancel"] = cancel
                completions = self.sampler.generate([token_list(p) for p in prompts], params, self._weight_version,
                                                    **extra)
        with self._counters_lock:
            self.generated["calls"] += 1
            self.generated["completions"] += len(completions)
            self.generated["tokens"] += sum(len(c.token_ids) for c in completions)
        if request.session is not None:
            self.trajectories.record(request.session, prompts, completions)
        return completions

    def abort_generation(self) -> bool:
        """End the sampler's generate call in flight, whichever caller it serves: its unfinished completions
        return at once with finish reason `abort` (the serving routes' `/pause?mode=abort`)."""
        self._aborts += 1
        return self.sampler.abort_generation()

    def pause_generation(self) -> bool:
        """Freeze the sampler's requests in flight until `resume_generation` (the serving routes' `/pause?mode=keep`):
        a weight sync in between takes effect for the rest of each. False where the sampler cannot."""
        return self.sampler.pause_generation()

    def resume_generation(self) -> None:
        self.sampler.resume_generation()

    def episode(self, session: str, release: bool = False) -> Episode:
        return self.trajectories.episode(parse(EpisodeRequest, {"session": session, "release": release}, "").session,
                                         release)

    def log_probs(self, sequences, *, with_entropy: bool = False, temperature: float = 1.0,
                  source: str = "trainer") -> LogProbsResult:
        seqs = self._validated(sequences)
        if not (isinstance(temperature, (int, float)) and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
            raise InvalidRequest("temperature", f"must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {temperature!r}")
        if source == "sampler":
            if with_entropy or temperature != 1.0:
                raise InvalidRequest("with_entropy" if with_entropy else "temperature",
                                     "the sampler scores plain log-probs only (temperature 1, no entropy)")
            with self._sampler_in_use():
                scores = self.sampler.score([(token_list(s.prompt_ids), token_list(s.response_ids)) for s in seqs])
            return LogProbsResult(logprobs=scores, weight_version=self._weight_version)
        if source not in ("trainer", "reference"):
            raise InvalidRequest("source", f"must be 'trainer', 'reference' or 'sampler', got {source!r}")
        post = self._post_chain([ProcessorSpec(name="apply_temperature", config={"temperature": temperature})]) if temperature != 1.0 else []
        micro = self._micro_batches(seqs)
        if source == "reference":
            if self.reference is None:
                raise InvalidRequest("source", "this job has no reference model: start it with reference.enable")
            with self._reference_lock:
                outputs = self.reference.forward(micro, post, with_entropy)
            logprobs, entropy = _per_sequence(len(seqs), [mb for mb, _ in outputs], [out for _, out in outputs], with_entropy)
            return LogProbsResult(logprobs=logprobs, entropy=entropy, weight_version=self._weight_version)
        # Lock order everywhere: train, critic, weights, sampler.
        with (nullcontext() if self.engine.concurrent_forward else self._train_lock), self._weights_lock:
            outputs = self.engine.forward(micro, post, with_entropy)
        micro, outs = [mb for mb, _ in outputs], [out for _, out in outputs]
        logprobs, entropy = _per_sequence(len(seqs), micro, outs, with_entropy)
        return LogProbsResult(logprobs=logprobs, entropy=entropy, weight_version=self._weight_version,
                              routed_experts=_routes_taken(len(seqs), micro, outs))

    def _critic_engine(self, field: str):
        if self.critic is None:
            raise InvalidRequest(field, "this job has no critic: start it with critic.enable")
        return self.critic

    def values(self, sequences) -> ValuesResult:
        seqs = self._validated(sequences)
        critic = self._critic_engine("values")
        micro = self._micro_batches(seqs)
        with self._critic_lock:
            outputs = critic.forward(micro, [], False)
        return ValuesResult(values=_split(len(seqs), [mb for mb, _ in outputs], [out for _, out in outputs], "values"))

    def fwd_bwd(self, sequences, loss: LossSpec | dict | str, *, return_logprobs: bool = False,
                with_entropy: bool = False, model: str = "policy") -> FwdBwdResult:
        if model not in ("policy", "critic"):
            raise InvalidRequest("model", f"must be 'policy' or 'critic', got {model!r}")
        if with_entropy and not return_logprobs:
            raise InvalidRequest("with_entropy", "entropy is returned with the log-probs: set return_logprobs too")
        if model == "critic" and return_logprobs:
            raise InvalidRequest("return_logprobs", "the critic has no log-probs")
        spec = parse(LossSpec, loss, "loss")
        entry = self.plugins.losses.get(spec.name, "loss.name")
        if entry.model != model:
            raise InvalidRequest("loss.name", f"loss {spec.name!r} trains the {entry.model}, not the {model}")
        loss_config = entry.parse_config(spec.config, "loss.config")
        post = self._post_chain(spec.post)
        if model == "critic" and post:
            raise InvalidRequest("loss.post", "the critic's values take no post-processors")
        seqs = self._validated(sequences)
        require_fields(seqs, entry.required_fields(loss_config), f"loss {spec.name!r}")
        refuse_unread(seqs, entry.reads, f"loss {spec.name!r}")
        engine = self._critic_engine("model") if model == "critic" else self.engine
        micro = self._micro_batches(seqs)
        call = (micro, entry, loss_config, post)
        values = None
        if model == "critic":
            with self._critic_lock:
                value, metrics, kept = self._accumulate(engine, self._critic_accumulated, call, True, False)
            values = _split(len(seqs), micro, kept, "values")
        else:
            with self._train_lock, self._sampler_asleep():
                value, metrics, kept = self._accumulate(engine, self._accumulated, call, return_logprobs, with_entropy)
        logprobs, entropy = _per_sequence(len(seqs), micro, kept, with_entropy) if return_logprobs else (None, None)
        return FwdBwdResult(
            loss=value,
            metrics=metrics,
            num_tokens=int(micro[0].inputs.num_tokens),
            num_sequences=len(seqs),
            computed_tokens=sum(int(mb.input_ids.numel()) for mb in micro),
            weight_version=self._weight_version,
            logprobs=logprobs,
            entropy=entropy,
            values=values,
        )

    @staticmethod
    def _accumulate(engine, accumulated: list[tuple], call: tuple, keep_outputs: bool, with_entropy: bool):
        """One fwd_bwd on `engine`, all or nothing: a failure rebuilds the gradients of the calls before it
        (the same deterministic computation, in the same order)."""
        try:
            result = engine.forward_backward(*call, keep_outputs=keep_outputs, with_entropy=with_entropy)
        except BaseException:
            engine.discard_gradients()
            for earlier in accumulated:
                engine.forward_backward(*earlier)
            raise
        accumulated.append(call)
        return result

    def discard_gradients(self, *, model: str = "policy") -> None:
        if model == "critic":
            critic = self._critic_engine("model")
            with self._critic_lock:
                critic.discard_gradients()
                self._critic_accumulated.clear()
            return
        if model != "policy":
            raise InvalidRequest("model", f"must be 'policy' or 'critic', got {model!r}")
        with self._train_lock:
            self.engine.discard_gradients()
            self._accumulated.clear()

    def step(self, learning_rate: float | None = None, *, adam: AdamSettings | dict | None = None,
             model: str = "policy") -> StepResult:
        if learning_rate is not None and not (
                isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate)
                and 0 <= learning_rate <= MAX_LEARNING_RATE):
            raise InvalidRequest("learning_rate", f"must be in [0, {MAX_LEARNING_RATE}], got {learning_rate!r}")
        if adam is not None:
            adam = parse(AdamSettings, adam, "adam")
        if model == "critic":
            critic = self._critic_engine("model")
            with self._critic_lock:
                if not critic.has_gradients:
                    raise InvalidRequest("step", "no critic gradients accumulated since its last step; call fwd_bwd "
                                                 "with model='critic' first")
                grad_norm, lr = critic.optimizer_step(learning_rate, adam)
                self._critic_accumulated.clear()
            return StepResult(step=critic.steps, grad_norm=grad_norm, learning_rate=lr)
        if model != "policy":
            raise InvalidRequest("model", f"must be 'policy' or 'critic', got {model!r}")
        with self._train_lock:
            if not self.engine.has_gradients:
                raise InvalidRequest("step", "no gradients accumulated since the last step; call fwd_bwd first")
            with self._weights_lock, self._sampler_asleep():
                grad_norm, lr = self.engine.optimizer_step(learning_rate, adam)
            self._accumulated.clear()
        self.learning_rate = lr
        return StepResult(step=self.engine.steps, grad_norm=grad_norm, learning_rate=lr)

    def add_adapter(self, name: str, path: str) -> None:
        """The sampler serves the LoRA adapter saved in `path` (`save_adapter`) as `name` on its base model, for
        requests that name it (`SamplingParams.adapter`)."""
        if not self.sampler.adapters:
            raise InvalidRequest("sampler.adapters", "this job's sampler serves no LoRA adapters (sampler.adapters: 0)")
        with self._sampler_in_use():
            self.sampler.add_adapter(name, path)
        self._adapters.add(name)

    def remove_adapter(self, name: str) -> None:
        self._adapters.discard(name)
        with self._sampler_in_use():
            self.sampler.remove_adapter(name)

    def save_adapter(self, path: str) -> None:
        """The policy's LoRA adapter (weights only) as PEFT saves it, for `add_adapter`."""
        if self.config.engine.lora is None:
            raise InvalidRequest("engine.lora", "this job trains all parameters: it has no adapter to save")
        with self._train_lock:
            self.engine.save_adapter(path)

    def save_full_weights(self, path: str) -> None:
        """The policy's full weights (LoRA merged), named as a sync names them, as sharded safetensors in `path`:
        what `save_hf` writes and `load_sampler_weights` reads."""
        from huggingface_hub import save_torch_state_dict

        with self._train_lock:
            weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.engine.named_full_weights()}
        os.makedirs(path, exist_ok=True)
        save_torch_state_dict(weights, path)

    def load_sampler_weights(self, path: str) -> int:
        """The sampler takes the weights `save_full_weights` wrote to `path` (not the trainer's), as a new weight
        version, which it returns; generate calls in flight are waited for, not crossed."""
        from safetensors import safe_open

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise InvalidRequest("path", f"{path!r} holds no safetensors weights")

        def weights():
            for name in files:
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)

        with self._sampler_lock:
            self.sampler.load_weights(weights(), self._weight_version + 1)
            self._weight_version += 1
        return self._weight_version

    def save_hf(self, path: str) -> None:
        """The policy as a Hugging Face model folder: its full weights (LoRA merged) under the base model's names,
        sharded safetensors, with the base model's config and tokenizer; `from_pretrained` loads it."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.save_full_weights(path)
        AutoConfig.from_pretrained(self.config.model_path).save_pretrained(path)
        AutoTokenizer.from_pretrained(self.config.model_path).save_pretrained(path)
        try:
            GenerationConfig.from_pretrained(self.config.model_path).save_pretrained(path)
        except OSError:  # the base model has none
            pass

    def adapter_layout(self) -> AdapterLayout | None:
        """A LoRA job's adapter: its rank and the modules it adapts (None for a full-parameter job)."""
        if self._adapter_layout is None and self.config.engine.lora is not None:
            self._adapter_layout = self.engine.adapter_layout()
        return self._adapter_layout

    @property
    def policy_untrained(self) -> bool:
        """The policy never stepped and holds no gradients: a LoRA job's adapter is as PEFT made it (B = 0)."""
        return self.engine.steps == 0 and not self._accumulated

    def shape_adapter(self, shape: AdapterShape | None) -> None:
        """The policy's adapter trains and computes as `shape` (a smaller rank, fewer modules) from now on, which
        is exact only from an untrained adapter on (`models/lora_shape.py`); None: all of it again."""
        with self._train_lock, self._weights_lock:
            if self._accumulated:
                raise InvalidRequest("lora_config", "the policy holds gradients not yet stepped: step or discard them "
                                     "before its adapter changes shape")
            self.engine.shape_adapter(shape)

    def park_policy(self, path: str) -> list[tuple]:
        """Take the policy's training state out of the engine: its trainable weights and optimizer state are
        written to `path` (a LoRA job's frozen base is not), its gradients dropped and returned as the fwd_bwd
        calls that made them. `resume_policy(path, calls, shape)` puts back exactly this state, so one engine can
        time-share several (Tinker's tenants)."""
        with self._train_lock:
            calls, self._accumulated = self._accumulated, []
            self.engine.discard_gradients()
            self.engine.save(path, {}, trainable_only=True)
            return calls

    def resume_policy(self, path: str, calls: list[tuple], shape: AdapterShape | None = None) -> None:
        """The state `park_policy` wrote to `path`, with its adapter's `shape`, its gradients rebuilt by running
        `calls` again (the same deterministic computation, in the same order)."""
        with self._train_lock, self._weights_lock:
            self.engine.load(path, trainable_only=True)
            if self.config.engine.lora is not None:
                self.engine.shape_adapter(shape)
            with self._sampler_asleep():
                for call in calls:
                    self.engine.forward_backward(*call)
            self._accumulated = list(calls)

    def sync_weights(self) -> int:
        # A sampler that crosses syncs takes the weights between two engine steps, generate calls in flight going
        # on under them; another one's calls are waited for.
        with self._train_lock, self._sampler_lock.shared() if self.sampler.crosses_syncs else self._sampler_lock:
            self.sampler.load_weights(self.engine.named_full_weights(), self._weight_version + 1)
            self._weight_version += 1
            self._synced_step = self.engine.steps
        return self._weight_version

    def save_checkpoint(self, path: str) -> CheckpointInfo:
        if not isinstance(path, str) or not path:
            raise InvalidRequest("path", "must be a directory path")
        with self._train_lock, self._critic_lock:
            if self.engine.has_gradients or self.critic is not None and self.critic.has_gradients:
                raise InvalidRequest("path", "gradients are accumulated but not stepped; call step before saving")
            self.engine.save(path, {"weight_version": self._weight_version, "synced_step": self._synced_step})
            if self.critic is not None:
                self.critic.save(os.path.join(path, CRITIC_DIR), {})
            save_file(self.sampler.random_state(), os.path.join(path, SAMPLER_RANDOM_STATE))
            return CheckpointInfo(path=path, step=self.engine.steps, weight_version=self._weight_version)

    def load_checkpoint(self, path: str, optimizer: bool = True, publish: bool = True) -> CheckpointInfo:
        """`publish=False` restores the training state and leaves the sampler's weights and version as they are
        (a Tinker model time-sharing the engine: the sampler holds another timeline's weights)."""
        if not isinstance(path, str) or not path:
            raise InvalidRequest("path", "must be a directory path")
        with self._train_lock, self._critic_lock, self._weights_lock, self._sampler_lock:
            if self.critic is not None and not os.path.isdir(os.path.join(path, CRITIC_DIR)):
                raise InvalidRequest("path", f"{path!r} holds no critic ({CRITIC_DIR}/): saved by a job without one")
            generators = self._saved_sampling_generators(path) if publish else None
            state = self.engine.load(path, optimizer=optimizer)
            if self.critic is not None:
                self.critic.load(os.path.join(path, CRITIC_DIR), optimizer=optimizer)
                self._critic_accumulated.clear()
            self._accumulated.clear()
            if not publish:
                return CheckpointInfo(path=path, step=self.engine.steps, weight_version=self._weight_version)
            # Weights stepped after the checkpoint's last sync were never published: they get a new version.
            unpublished = self.engine.steps != int(state.get("synced_step", self.engine.steps))
            version = int(state.get("weight_version", 0)) + int(unpublished)
            self.sampler.load_weights(self.engine.named_full_weights(), version)
            self._weight_version = version
            self._synced_step = self.engine.steps
            if generators is not None and generators.keys() == self.sampler.random_state().keys():
                self.sampler.set_random_state(generators)
            return CheckpointInfo(path=path, step=self.engine.steps, weight_version=self._weight_version)

    def _saved_sampling_generators(self, path: str) -> dict | None:
        """The sampler's generators as they were at the save (read before anything is restored: a file that does
        not read is refused with the job unchanged), to put back where the job has the saved layout (one sampler,
        or as many replicas), so that unseeded sampling draws what the saved job would have drawn next. A
        checkpoint from before they were kept has none: they stay as they are (which samples, never how)."""
        file = os.path.join(path, SAMPLER_RANDOM_STATE)
        if not os.path.isfile(file):
            return None
        try:
            return load_file(file)
        except Exception as err:  # noqa: BLE001 -- safetensors' own errors: the file is not what it says
            raise InvalidRequest("path", f"{file} does not read as the sampler's generators: {err}") from None

    def close(self) -> None:
        """Stop what this job started outside its process (a trainer group's and a sampler pool's Ray actors)."""
        self._close(self.sampler)
        self._close(self.engine)

    @staticmethod
    def _close(part) -> None:
        close = getattr(part, "close", None)
        if close is not None:
            close()

    @cached_property
    def weights_fingerprint(self) -> str | None:
        """Of the checkpoint the job started from (`model_path`): a client checks it holds the same weights."""
        return checkpoint_fingerprint(self.config.model_path)

    def describe(self) -> dict:
        """The model's defining shape (for clients to check they use the same model), and counters."""
        from transformers import AutoConfig

        try:
            steps, trainer_error = self.engine.steps, None
        except ArcticRLError as err:  # a trainer group that lost a rank: status still answers, and says so
            steps, trainer_error = None, str(err)
        return {
            "model": model_shape(AutoConfig.from_pretrained(self.config.model_path).to_dict()),
            "optimizer_steps": steps,
            "learning_rate": self.learning_rate,
            **({"trainer_error": trainer_error} if trainer_error else {}),
            "weight_version": self._weight_version,
            "generated": dict(self.generated),
            "episodes": self.trajectories.describe(),
            "sync_route": self.sampler.sync_route,
            "crosses_syncs": self.sampler.crosses_syncs,
            "max_context": self.sampler.max_context,
            "weights_fingerprint": self.weights_fingerprint,
            # The routing the trainer replays: `off` where the job does not, or its model is dense (nothing to replay).
            "router_replay": self.config.router_replay if getattr(self.engine, "replay_shape", None) else "off",
            "trainer": getattr(self.engine, "placement",
                               [{"rank": 0, "node": "driver", "pid": os.getpid(), "healthy": True}]),
            "reference": None if self.reference is None else self.reference.describe(),
            "critic": None if self.critic is None else self.critic.describe(),
            "sampler": (self.sampler.describe() if hasattr(self.sampler, "describe") else
                        [{"replica": 0, "node": "driver", "pid": os.getpid(), "healthy": True,
                          "weight_version": self._weight_version, "placement": self.config.sampler.placement,
                          "compute_threads": getattr(self.sampler, "compute_threads", None)}]),
        }

    def state_digest(self) -> str:
        """Hash of all weights and optimizer state (for tests and for checking that a request changed nothing)."""
        with self._train_lock, self._critic_lock, self._weights_lock:
            if self.critic is None:
                return self.engine.state_digest()
            return hashlib.sha256(f"{self.engine.state_digest()}{self.critic.state_digest()}".encode()).hexdigest()


