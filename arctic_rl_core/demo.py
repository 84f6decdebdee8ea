"""The demo job: a short GRPO loop on a tiny model, through the in-process training API.

The task is deliberately simple so that learning is visible in a minute on a
CPU: the reward is the fraction of response tokens that contain a digit.
"""

from __future__ import annotations

import os
import random
import statistics
import time

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.types import LossSpec, SamplingParams, Sequence

DEMO_PROMPTS = [
    "question: How many orders were placed in 2024? answer:",
    "question: What is the capital of France? answer:",
    "question: Which city has the most customers? answer:",
    "SELECT COUNT(*) FROM orders WHERE",
    "context: The river flows through the valley. question:",
    "CREATE TABLE users (id INTEGER PRIMARY KEY,",
]


def digit_reward(text: str, tokens: list[str]) -> float:
    if not tokens:
        return 0.0
    return sum(any(ch.isdigit() for ch in tok) for tok in tokens) / len(tokens)


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO: reward minus the group mean, over the group's standard deviation."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def run_demo(api: TrainingAPI, tokenizer, *, steps: int, group_size: int, prompts_per_step: int,
             max_tokens: int, seed: int, log=print) -> list[dict]:
    rng = random.Random(seed)
    prompts = [tokenizer.encode(p) for p in DEMO_PROMPTS]
    history = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        batch_prompts = rng.sample(prompts, k=min(prompts_per_step, len(prompts)))
        completions = api.generate(
            batch_prompts, SamplingParams(n=group_size, temperature=1.0, max_tokens=max_tokens, seed=seed + step)
        )
        sequences, rewards = [], []
        for index, prompt in enumerate(batch_prompts):
            group = [c for c in completions if c.prompt_index == index]
            group_rewards = [digit_reward("", tokenizer.convert_ids_to_tokens(c.token_ids)) for c in group]
            rewards.extend(group_rewards)
            for completion, advantage in zip(group, group_advantages(group_rewards)):
                sequences.append(
                    Sequence(
                        prompt_ids=prompt,
                        response_ids=completion.token_ids,
                        group_id=f"{step}-{index}",
                        advantages=[advantage] * len(completion.token_ids),
                        behaviour_logprobs=completion.logprobs,
                        behaviour_version=completion.weight_version,
                    )
                )
        result = api.fwd_bwd(sequences, LossSpec(name="grpo", config={"eps_clip": 0.2, "eps_clip_higher": 0.28}))
        stepped = api.step()
        version = api.sync_weights()
        row = {
            "step": step,
            "loss": result.loss,
            "reward": statistics.fmean(rewards),
            "grad_norm": stepped.grad_norm,
            "weight_version": version,
            "seconds": time.perf_counter() - t0,
        }
        history.append(row)
        log(
            f"step {step:3d}  loss {row['loss']:+.4f}  reward {row['reward']:.3f}  "
            f"grad_norm {row['grad_norm']:.3f}  weight_version {version}  ({row['seconds']:.1f}s)"
        )
    return history


def main(args) -> int:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.models.tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the demo prints its own progress
    model_dir = args.model_dir
    if not os.path.isdir(model_dir):
        print(f"building a tiny random Qwen3 model in {model_dir}")
        make_tiny_model("qwen3", model_dir, layers=2, hidden=64)
    api = InProcessBackend(
        {"model_path": model_dir, "engine": {"zero_stage": args.zero_stage, "learning_rate": args.learning_rate, "seed": args.seed}}
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    history = run_demo(api, tokenizer, steps=args.steps, group_size=args.group_size, prompts_per_step=args.prompts,
                       max_tokens=args.max_tokens, seed=args.seed)
    first = statistics.fmean(h["reward"] for h in history[:3])
    last = statistics.fmean(h["reward"] for h in history[-3:])
    print(f"mean reward: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; weight_version {api.weight_version}")
    return 0
