"""Interim sampler: transformers' own `generate` on a separate copy of the weights.

It holds its own model, so what it samples is exactly the last synced
weight version, as a vLLM engine would. The vLLM sampler replaces it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from arctic_rl_core.config import BackendConfig
from arctic_rl_core.models.lora_files import lora_deltas
from arctic_rl_core.models.rope_scaling import context_window, model_config
from arctic_rl_core.models.router_replay import load_router_replay
from arctic_rl_core.samplers.base import Sampler
from arctic_rl_core.types import Completion, RoutedExperts, SamplingParams


class _Aborted(StoppingCriteria):
    """Every row stops once `abort_generation` was called."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _pairs(indices: torch.Tensor, values: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Per position, (token id, log-prob) pairs from a top-k result."""
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


class TransformersSampler(Sampler):
    sync_route = "direct"  # copies into its own model's parameters
    # Hugging Face's generate has neither penalty; nor do we pass it constraints, biases or banned words.
    unsupported_sampling = Sampler.unsupported_sampling | {"presence_penalty", "frequency_penalty"}

    def __init__(self, config: BackendConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, config.sampler.dtype or config.engine.dtype)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        hf_config = model_config(config.model_path, config.rope_scaling)
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, config=hf_config, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.max_context = context_window(hf_config)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self._abort = threading.Event()
        self.adapters = config.sampler.adapters
        self._adapters: dict[str, dict[str, torch.Tensor]] = {}
        """name -> each base weight's change under the adapter."""
        self.router_replay = load_router_replay(self.model, hf_config, self.device) if config.router_replay == "R3" else None
        """R3: each completion carries the routing it was sampled with."""

    def add_adapter(self, name: str, path: str) -> None:
        params = dict(self.model.named_parameters())
        deltas = lora_deltas(path, next(iter(params.values())).dtype)
        unknown = sorted(set(deltas) - set(params))
        if unknown:
            raise ValueError(f"{path}: the adapter changes weights this model lacks: {unknown[:3]}")
        misshapen = sorted(key for key, delta in deltas.items() if delta.shape != params[key].shape)
        if misshapen:
            raise ValueError(f"{path}: the adapter's changes do not fit the weights {misshapen[:3]}")
        self._adapters[name] = {key: delta.to(self.device) for key, delta in deltas.items()}

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    @contextmanager
    def _adapted(self, name: str | None):
        """The model with the adapter merged in for one call, then its weights exactly as they were (calls run
        one at a time: the backend holds the sampler's lock alone for a sampler without concurrent_generate)."""
        if name is None:
            yield
            return
        params = dict(self.model.named_parameters())
        kept = {key: params[key].detach().clone() for key in self._adapters[name]}
        try:
            for key, delta in self._adapters[name].items():
                params[key].add_(delta)
            yield
        finally:
            for key, weight in kept.items():
                params[key].copy_(weight)

    @contextmanager
    def _routes_recorded(self, rows: int):
        """With R3, a list that collects each forward of `generate` its routing, [rows, tokens, layers, top_k]."""
        replay = self.router_replay
        if replay is None:
            yield None
            return
        steps: list[torch.Tensor] = []

        def start(module, args):
            replay.use(record=True)

        def end(module, args, output):
            steps.append(replay.recorded.view(rows, -1, replay.num_layers, replay.top_k))

        hooks = [self.model.register_forward_pre_hook(start), self.model.register_forward_hook(end)]
        try:
            yield steps
        finally:
            for hook in hooks:
                hook.remove()
            replay.use()

    def abort_generation(self) -> bool:
        self._abort.set()
        return True

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingParams, weight_version: int) -> list[Completion]:
        with self._adapted(sampling.adapter):
            return self._generate(prompts, sampling, weight_version)

    def _generate(self, prompts, sampling: SamplingParams, weight_version: int) -> list[Completion]:
        from transformers import GenerationConfig

        stop_ids = ([] if sampling.ignore_eos else self.eos_ids) + sampling.stop_token_ids
        greedy = sampling.temperature == 0
        gen_config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else sampling.top_k,  # 0 turns it off; None would be Hugging Face's default, 50
            min_p=None if greedy else (sampling.min_p or None),
            repetition_penalty=None if sampling.repetition_penalty == 1 else sampling.repetition_penalty,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.min_tokens or None,
            eos_token_id=stop_ids or None,
            pad_token_id=stop_ids[0] if stop_ids else 0,
            stop_strings=sampling.stop or None,
            return_dict_in_generate=True,
            output_logits=True,
            output_scores=sampling.logprobs_of == "sampler",
        )
        completions = []
        self._abort.clear()
        aborted = _Aborted(self._abort)
        # A seeded call samples from its own generator state and leaves the process's as it was; an unseeded one
        # draws from the process's, which moves on: forking it there too would replay the same draws every call.
        with torch.random.fork_rng(devices=[], enabled=sampling.seed is not None):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            for index, prompt in enumerate(prompts):
                if self._abort.is_set():  # the prompts not yet started end with nothing sampled
                    completions += [Completion(prompt_index=index, token_ids=[], logprobs=[], finish_reason="abort",
                                               weight_version=weight_version) for _ in range(sampling.n)]
                    continue
                ids = torch.tensor([prompt] * sampling.n, device=self.device)
                with self._routes_recorded(sampling.n) as steps:
                    out = self.model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                        tokenizer=self.tokenizer if sampling.stop else None, stopping_criteria=StoppingCriteriaList([aborted]),
                    )
                # Every forwarded token's routing: the prompt and each sampled token but the last (never forwarded).
                routes = torch.cat(steps, dim=1).cpu().numpy() if steps else None
                new = out.sequences[:, ids.shape[1]:]
                if sampling.logprobs_of == "sampler":  # what was sampled from: penalised, scaled, truncated
                    logits = torch.stack(out.scores, dim=1).float()
                else:  # the temperature-scaled model's: what the trainer's `apply_temperature` computes
                    logits = torch.stack(out.logits, dim=1).float()
                    if not greedy:
                        logits = logits / sampling.temperature
                all_logprobs = torch.log_softmax(logits, dim=-1)
                logprobs = all_logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)
                ranks = 1 + (all_logprobs > logprobs.unsqueeze(-1)).sum(-1)
                top = torch.topk(all_logprobs, sampling.logprobs, dim=-1) if sampling.logprobs else None
                prompt_scores = self._prompt_logprobs(prompt, sampling.prompt_logprobs)
                for row in range(new.shape[0]):
                    tokens = new[row].tolist()
                    end, reason = self._end(tokens, stop_ids, sampling.stop)
                    if reason == "length" and self._abort.is_set() and end < sampling.max_tokens:
                        reason = "abort"
                    completions.append(
                        Completion(
                            prompt_index=index,
                            token_ids=tokens[:end],
                            logprobs=logprobs[row, :end].tolist(),
                            finish_reason=reason,
                            weight_version=weight_version,
                            top_logprobs=None if top is None else _pairs(top.indices[row, :end], top.values[row, :end]),
                            ranks=ranks[row, :end].tolist(), prompt_logprobs=prompt_scores,
                            routed_experts=None if routes is None or not end else
                            RoutedExperts.of(routes[row, : len(prompt) + end - 1]),
                        )
                    )
        return completions

    def _end(self, tokens: list[int], stop_ids: list[int], stops: list[str]) -> tuple[int, str]:
        """Where a sampled row ends: after a stop token or the token completing a stop string (a row that
        ended early is padded after it: the padding was never sampled)."""
        for pos, tok in enumerate(tokens):
            if tok in stop_ids or stops and any(s in self.tokenizer.decode(tokens[: pos + 1]) for s in stops):
                return pos + 1, "stop"
        return len(tokens), "length"

    def _prompt_logprobs(self, prompt: list[int], k: int | None):
        """Each prompt token after the first: its own (id, log-prob), then the k most likely (temperature 1)."""
        if k is None:
            return None
        ids = torch.tensor([prompt], device=self.device)
        scores = torch.log_softmax(self.model(ids).logits[0, :-1].float(), -1)
        own = scores.gather(-1, ids[0, 1:, None])
        top = torch.topk(scores, k, dim=-1)
        return [[(int(t), float(v))] + pairs for t, v, pairs in
                zip(prompt[1:], own[:, 0].tolist(), _pairs(top.indices, top.values))]

    @torch.no_grad()
    def score(self, sequences):
        scores = []
        for prompt, response in sequences:
            ids = torch.tensor([prompt + response], device=self.device)
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
            targets = torch.tensor(response, device=self.device)
            scores.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].tolist())
        return scores

    @torch.no_grad()
    def held_weights(self):
        return self.model.named_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"sampler model has no parameter {name!r}")
            params[name].copy_(tensor.to(params[name].dtype))
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"sync left sampler parameters unset: {sorted(missing)[:5]}")
        return len(loaded)
