"""The GRPO driver behind `arctic-rl train RECIPE.yaml`.

It is the CPU-side controller a framework would be: it loads data, tokenizes,
scores and computes advantages, and does all model work through the training
API (an embedded backend, or a server at `backend.url`). Order of a run:
check everything that needs no model (config, data files, loss), build the
tiny model if asked, connect the backend, SFT warm-up, held-out evaluation,
GRPO steps (pipelined generation), periodic evaluation and checkpoints,
final evaluation, plot and summary.
"""

from __future__ import annotations

import glob
import json
import os
import random
import resource
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.rope_scaling import context_window, model_config
from arctic_rl_core.pipeline import RolloutBatch, RolloutPipeline
from arctic_rl_recipes.config import RecipeConfig
from arctic_rl_recipes.metrics import PHASES, MetricsLog, plot_run
from arctic_rl_recipes.multihop.task import MultihopTask
from arctic_rl_recipes.rewards import RewardPool
from arctic_rl_recipes.task import Example
from arctic_rl_recipes.text2sql.task import Text2SQLTask
from arctic_rl_core.types import LossSpec, SamplingParams, Sequence, behaviour

TASKS = {"text2sql": Text2SQLTask, "multihop_qa": MultihopTask}
STATE_FILE = "driver_state.json"


@dataclass
class Variant:
    """How GRPO steps run: ZoRRo on or off, and how far generation runs ahead."""

    zorro: bool
    max_staleness: int

    @property
    def label(self) -> str:
        return f"{'zorro' if self.zorro else 'naive'}+{'sync' if self.max_staleness == 0 else f'async{self.max_staleness}'}"


class PhaseTimer:
    def __init__(self):
        self.seconds = {phase: 0.0 for phase in PHASES}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0


def group_advantages(rewards: list[float], normalize_std: bool) -> list[float]:
    mean = statistics.fmean(rewards)
    if not normalize_std:
        return [r - mean for r in rewards]
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


class RecipeRun:
    def __init__(self, config: RecipeConfig, *, log=print):
        self.config = config
        self.log = log
        self.out = config.output_dir
        os.makedirs(self.out, exist_ok=True)
        # 1. Everything that needs no model: data files, formats, the loss.
        self.task = TASKS[config.task.name](config.task, self.out)
        self.train_examples = self.task.load("train")
        self.eval_examples = self.task.load("eval")[: config.eval.max_examples]
        self.resume_state, self.resume_path = self._find_resume()
        if config.backend.url is None:
            self._check_loss()
        # 2. The model (built if the recipe asks for a tiny one) and its tokenizer.
        self.model_path = self._ensure_model()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_id = self.tokenizer.eos_token_id
        fit_contexts = getattr(self.task, "fit_contexts", None)  # a task whose contexts are sized in tokens
        if fit_contexts is not None:
            def count_tokens(text: str) -> int:
                return len(self.tokenizer.encode(text))

            self.train_examples = fit_contexts("train", self.train_examples, count_tokens)
            self.eval_examples = fit_contexts("eval", self.eval_examples, count_tokens)
        self.train_prompts, self.train_examples = self._tokenize(self.train_examples, "train")
        self.eval_prompts, self.eval_examples = self._tokenize(self.eval_examples, "eval")
        split = config.sft.examples
        if split is not None and split >= len(self.train_examples):
            raise InvalidRequest("sft.examples", f"leaves no GRPO prompts: the training split has {len(self.train_examples)}")
        self.sft_pool = range(split if split is not None else len(self.train_examples))
        self.grpo_pool = range(split or 0, len(self.train_examples))
        self.api: TrainingAPI | None = None
        self.rewards: RewardPool | None = None

    # -- checks before any model loads -------------------------------------------------------------

    def _check_loss(self) -> None:
        from arctic_rl_core.plugins import load_plugins

        spec = self.config.grpo.loss
        entry = load_plugins().losses.get(spec.name, "grpo.loss.name")
        loss_config = entry.parse_config(spec.config, "grpo.loss.config")
        if "ref_logprobs" in entry.required_fields(loss_config):
            raise InvalidRequest("grpo.loss.config.kl_loss_coef",
                                 "a KL penalty to a reference model needs reference log-probs, which this driver does not compute")

    def _find_resume(self) -> tuple[dict | None, str | None]:
        resume = self.config.resume
        if resume is None:
            return None, None
        if resume == "auto":
            found = sorted(glob.glob(os.path.join(self.out, "checkpoints", "step_*", STATE_FILE)))
            if not found:
                return None, None  # nothing saved yet: a fresh start
            path = os.path.dirname(found[-1])
        else:
            path = resume
        state_file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(state_file):
            raise InvalidRequest("resume", f"{path} is not a checkpoint of this driver (no {STATE_FILE})")
        with open(state_file) as f:
            return json.load(f), path

    def _ensure_model(self) -> str:
        spec = self.config.model
        if os.path.isdir(spec.path):
            if not os.path.isfile(os.path.join(spec.path, "config.json")):
                raise InvalidRequest("model.path", f"{spec.path} holds no config.json (not a Hugging Face model folder)")
            return spec.path
        if spec.tiny is None:
            raise InvalidRequest("model.path", f"folder not found: {spec.path} (set model.tiny to build a tiny model there)")
        from arctic_rl_core.models.tiny import make_tiny_model

        t = spec.tiny
        self.log(f"building a tiny {t.family} model in {spec.path} (tokenizer trained on the training texts)")
        return make_tiny_model(t.family, spec.path, layers=t.layers, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                               vocab_size=t.vocab_size, max_positions=t.max_positions, seed=t.seed,
                               corpus=[e.prompt + e.reference for e in self.train_examples])

    def _tokenize(self, examples: list[Example], split: str) -> tuple[list[list[int]], list[Example]]:
        context = context_window(model_config(self.model_path, self.config.model.rope_scaling, "model.path"))
        limit = self.config.data.max_prompt_tokens or context - self.config.grpo.max_tokens
        prompts, kept = [], []
        for example in examples:
            ids = self.tokenizer.encode(example.prompt)
            if len(ids) <= limit:
                prompts.append(ids)
                kept.append(example)
        if not kept:
            raise InvalidRequest("data.max_prompt_tokens", f"every {split} prompt is longer than {limit} tokens")
        if len(kept) < len(examples):
            self.log(f"{split}: dropped {len(examples) - len(kept)} of {len(examples)} prompts longer than {limit} tokens")
        return prompts, kept

    # -- the backend ---------------------------------------------------------------------------------

    def backend_config(self) -> dict:
        b = self.config.backend
        rope_scaling = self.config.model.rope_scaling
        return {"model_path": self.model_path, "rope_scaling": rope_scaling and rope_scaling.model_dump(exclude_none=True),
                "engine": b.engine.model_dump(), "sampler": b.sampler.model_dump(),
                "zorro": b.zorro.model_dump(), "placement": b.placement, "ray": b.ray.model_dump()}

    def connect(self) -> TrainingAPI:
        b = self.config.backend
        if b.url is None:
            from arctic_rl_core.backend import InProcessBackend

            self.api = InProcessBackend(self.backend_config())
        else:
            from arctic_rl_core.client import ArcticRLClient

            client = ArcticRLClient(b.url, token=b.token or os.environ.get("ARCTIC_RL_TOKEN"))
            client.initialize(self.backend_config())  # refuses if the server runs a different job
            self.api = client
        self.syncs_cross_rollouts = self._backend_status()["crosses_syncs"]
        """The sampler takes new weights while a rollout is in flight (its tokens then carry two versions)."""
        self.rewards = RewardPool(self.task.reward_fn, workers=self.config.reward.workers,
                                  timeout_s=self.config.reward.timeout_s)
        return self.api

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.api is not None and self.config.backend.url is None:
            self.api.close()  # an embedded backend's Ray actors stop with the run

    # -- phases ----------------------------------------------------------------------------------------

    def sft(self, steps: int) -> list[float]:
        cfg = self.config.sft
        rng = random.Random(self.config.seed)
        losses = []
        for _ in self._progress(range(steps), "SFT"):
            batch = rng.sample(self.sft_pool, k=min(cfg.batch_size, len(self.sft_pool)))
            seqs = [Sequence(prompt_ids=self.train_prompts[i],
                             response_ids=self.tokenizer.encode(self.train_examples[i].reference) + [self.eos_id])
                    for i in batch]
            losses.append(self.api.fwd_bwd(seqs, LossSpec(name="sft")).loss)
            self.api.step(cfg.learning_rate)
        self.api.sync_weights()
        return losses

    def evaluate(self) -> dict:
        """Greedy held-out accuracy under the sampler's weights."""
        max_tokens = self.config.eval.max_tokens or self.config.grpo.max_tokens
        t0 = time.perf_counter()
        completions = self.api.generate(self.eval_prompts, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens))
        scored = self.rewards.score([self._decode(c.token_ids) for c in completions],
                                    [self.eval_examples[c.prompt_index].reward_args for c in completions])
        return {"accuracy": statistics.fmean(s.correct for s in scored.scores),
                "reward": statistics.fmean(s.reward for s in scored.scores),
                "response_length": statistics.fmean(len(c.token_ids) for c in completions),
                "examples": len(completions), "seconds": time.perf_counter() - t0}

    def prompt_indices(self, step: int) -> list[int]:
        """The training prompts of GRPO step `step`: a function of the seed and the step, so a resumed run
        sees the same data."""
        k = min(self.config.grpo.prompts_per_step, len(self.grpo_pool))
        return random.Random(f"{self.config.seed}-{step}").sample(self.grpo_pool, k=k)

    def pipeline(self, first_step: int, max_staleness: int) -> RolloutPipeline:
        g = self.config.grpo
        sampling = SamplingParams(n=g.group_size, temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens)
        return RolloutPipeline(self.api, lambda s: [self.train_prompts[i] for i in self.prompt_indices(first_step + s)],
                               sampling, max_staleness=max_staleness)

    def grpo_step(self, step: int, batch: RolloutBatch, timer: PhaseTimer, rollouts: RolloutPipeline, *,
                  train_all: bool = False) -> dict:
        """Score one step's rollouts, compute group advantages and train on them, then sync the weights
        (`train_all`: every sample, even of groups with one reward, so timed steps do equal work). Where the sampler
        cannot take weights under a rollout in flight (pipelined), the sync waits for it: timed as its own phase,
        `rollout_wait`; vLLM's takes them between two engine steps and the rollout goes on under them."""
        g = self.config.grpo
        indices = self.prompt_indices(step)
        completions = batch.completions
        with timer("reward"):
            scored = self.rewards.score([self._decode(c.token_ids) for c in completions],
                                        [self.train_examples[indices[c.prompt_index]].reward_args for c in completions])
        by_prompt: dict[int, list[int]] = {}
        for j, c in enumerate(completions):
            by_prompt.setdefault(c.prompt_index, []).append(j)
        sequences, uniform = [], 0
        for p, members in by_prompt.items():
            rewards = [scored.scores[j].reward for j in members]
            if len(members) < 2 or (g.skip_uniform_groups and not train_all and max(rewards) == min(rewards)):
                uniform += 1
                continue
            for j, adv in zip(members, group_advantages(rewards, g.normalize_std)):
                c = completions[j]
                sequences.append(Sequence(prompt_ids=batch.prompts[p], response_ids=c.token_ids, group_id=f"{step}-{p}",
                                          advantages=[adv] * len(c.token_ids), **behaviour(c)))
        metrics = {}
        if sequences:
            if self._needs_proximal():
                with timer("log_probs"):
                    proximal = self.api.log_probs(sequences).logprobs
                for seq, lp in zip(sequences, proximal):
                    seq.proximal_logprobs = lp
            with timer("fwd_bwd"):
                result = self.api.fwd_bwd(sequences, g.loss)
            with timer("step"):
                stepped = self.api.step(g.learning_rate)
            if not self.syncs_cross_rollouts:
                with timer("rollout_wait"):
                    rollouts.wait_for_oldest()
            with timer("sync"):
                self.api.sync_weights()
            metrics = {"loss": result.loss, "grad_norm": stepped.grad_norm,
                       "kl": result.metrics.get("kl", result.metrics.get("ppo_kl", 0.0)),
                       "clip_frac": result.metrics.get("clip_frac", 0.0),
                       # What fwd_bwd ran (ZoRRo: each shared prompt once) against every sequence in full.
                       "computed_tokens": result.computed_tokens,
                       "unshared_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in sequences)}
        response_tokens = [len(c.token_ids) for c in completions]
        sampled_logprobs = [lp for c in completions for lp in c.logprobs]
        return {
            "reward": statistics.fmean(s.reward for s in scored.scores) if completions else 0.0,
            "accuracy": statistics.fmean(s.correct for s in scored.scores) if completions else 0.0,
            "response_length": statistics.fmean(response_tokens) if completions else 0.0,
            # Mean negative log-prob of the sampled tokens: a Monte-Carlo estimate of the policy's entropy.
            "entropy": -statistics.fmean(sampled_logprobs) if sampled_logprobs else 0.0,
            **metrics,
            "samples": len(completions), "groups_trained": len(by_prompt) - uniform, "groups_uniform": uniform,
            "staleness": batch.staleness, "dropped": batch.dropped,
            "reward_timeouts": scored.timeouts, "reward_errors": scored.errors,
            "tokens": sum(response_tokens) + sum(len(batch.prompts[c.prompt_index]) for c in completions),
            # This process's peak resident memory so far (an embedded backend's trainer and sampler included).
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }

    def _needs_proximal(self) -> bool:
        config = self.config.grpo.loss.config
        return bool(config.get("use_decoupled_loss")) and config.get("prox_logp_method", "recompute") == "recompute"

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _progress(self, iterable, desc: str):
        if not self.config.progress:
            return iterable
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, dynamic_ncols=True, leave=False)

    # -- checkpoints -------------------------------------------------------------------------------------

    def save(self, step: int, state: dict) -> str:
        path = os.path.abspath(os.path.join(self.out, "checkpoints", f"step_{step:06d}"))
        self.api.save_checkpoint(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump({**state, "step": step}, f)
        saved = sorted(glob.glob(os.path.join(self.out, "checkpoints", "step_*")))
        for old in saved[: -self.config.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    # -- the whole run --------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.config
        if self.api is None:
            self.connect()
        state = dict(self.resume_state or {})
        metrics = MetricsLog(self.out, resume_after_step=state.get("step") if self.resume_path else None)
        try:
            if self.resume_path:
                self.api.load_checkpoint(self.resume_path)
                self.log(f"resumed from {self.resume_path} (GRPO step {state['step']})")
            else:
                start = self.evaluate()
                metrics.write({"kind": "eval", "step": 0, "phase": "start", **start})
                state = {"step": 0, "accuracy_start": start["accuracy"]}
                if cfg.sft.steps:
                    t0 = time.perf_counter()
                    losses = self.sft(cfg.sft.steps)
                    after = self.evaluate()
                    metrics.write({"kind": "eval", "step": 0, "phase": "after_sft", **after,
                                   "sft_loss_first": losses[0], "sft_loss_last": losses[-1],
                                   "sft_seconds": time.perf_counter() - t0})
                    state["accuracy_after_sft"] = after["accuracy"]
                    self.log(f"held-out accuracy: start {start['accuracy']:.3f}, after {cfg.sft.steps} SFT steps "
                             f"{after['accuracy']:.3f}")
            self._grpo(state, metrics, Variant(cfg.backend.zorro.enable, cfg.pipeline.max_staleness))
            rows = metrics.rows()
        finally:
            metrics.close()
        plot = plot_run(rows, os.path.join(self.out, "plot.png"))
        summary = self._summary(state, rows, plot, metrics)
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def _grpo(self, state: dict, metrics: MetricsLog, variant: Variant) -> None:
        cfg = self.config
        first = state["step"] + 1
        pipe = self.pipeline(first, variant.max_staleness)
        dropped = state.get("dropped_total", 0)
        try:
            bar = self._progress(range(first, cfg.grpo.steps + 1), "GRPO")
            for step in bar:
                t0 = time.perf_counter()
                timer = PhaseTimer()
                with timer("generate"):
                    batch = pipe.next_batch()
                row = self.grpo_step(step, batch, timer, pipe)
                seconds = time.perf_counter() - t0
                dropped += batch.dropped
                row.update({"kind": "train", "step": step, "seconds": seconds, "tokens_per_s": row["tokens"] / seconds,
                            "weight_version": self.api.weight_version,
                            **{f"time/{p}": s for p, s in timer.seconds.items()}})
                metrics.write(row)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(reward=f"{row['reward']:.2f}", s_per_step=f"{seconds:.2f}")
                last = step == cfg.grpo.steps
                if last or (cfg.eval.every and step % cfg.eval.every == 0):
                    result = self.evaluate()
                    metrics.write({"kind": "eval", "step": step, "phase": "grpo", **result})
                    state["accuracy_final"] = result["accuracy"]
                state.update(step=step, dropped_total=dropped)
                if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or last):
                    self.save(step, state)
        finally:
            pipe.close()
        if "accuracy_final" not in state:  # nothing left to run (resumed at the end, or 0 steps)
            state["accuracy_final"] = self.evaluate()["accuracy"]

    def _summary(self, state: dict, rows: list[dict], plot: str, metrics: MetricsLog) -> dict:
        train = [r for r in rows if r.get("kind") == "train"]
        return {
            "task": self.config.task.name,
            "grpo_steps": state["step"],
            "accuracy_start": state.get("accuracy_start"),
            "accuracy_after_sft": state.get("accuracy_after_sft"),
            "accuracy_final": state["accuracy_final"],
            "median_seconds_per_step": statistics.median(r["seconds"] for r in train) if train else None,
            "median_seconds_per_phase": {p: statistics.median(r[f"time/{p}"] for r in train) for p in PHASES} if train else {},
            "dropped_stale": state.get("dropped_total", 0),
            "metrics": metrics.path,
            "tensorboard": metrics.tensorboard_dir,
            "plot": plot,
            "placement": self._placement(),
        }

    def _backend_status(self) -> dict:
        return self.api.describe() if self.config.backend.url is None else self.api.status()["backend"]

    def _placement(self) -> dict:
        """Where each trainer rank and sampler replica runs at the end (a Ray job's nodes), and how many times
        each replica was replaced."""
        described = self._backend_status()
        keep = ("rank", "replica", "node", "node_id", "pid", "replacements")
        return {role: [{k: row[k] for k in keep if k in row} for row in described[role]]
                for role in ("trainer", "sampler")}
