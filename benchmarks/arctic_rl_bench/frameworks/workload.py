"""The workload every column of `bench frameworks` runs: the seed's text-to-SQL GRPO shape, scaled to a CPU.

Imported by the orchestrator (the main environment) and by each framework's runner (in that framework's own
environment, by path), so it needs nothing beyond the standard library until a function asks for pandas or
transformers.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    prompts_per_step: int
    samples_per_prompt: int
    prompt_tokens: int
    """Each prompt's length, rendered by the chat template (the filler is cut to reach it within a few tokens)."""
    response_tokens: int

    def dedup_bound(self) -> float:
        """The most ZoRRo can save on log-probs and the update: positions computed without sharing over those
        computed with each group's prompt once. Attention's quadratic part is left out, so this is a floor on
        the bound at long prompts."""
        n, p, r = self.samples_per_prompt, self.prompt_tokens, self.response_tokens
        return n * (p + r) / (p + n * r)

    def compute_bound(self, model: dict, vocab: int) -> float:
        """The same bound in multiply-adds of `model` (MODEL's keys; `vocab`: the built model's): per position its projections and MLP, per
        (query, key) pair its attention scores and weighted values; the head only at response positions, in both.
        Sharing computes each prompt once, but each response still attends its whole prompt, so where attention
        weighs as much as the projections (short hidden, long prompt) this is well below `dedup_bound`."""
        n, p, r = self.samples_per_prompt, self.prompt_tokens, self.response_tokens
        h, mlp = model["hidden"], model["intermediate"]
        kv = h * model["kv_heads"] // model["heads"]
        per_position = model["layers"] * (2 * h * h + 2 * h * kv + 3 * h * mlp)
        per_pair = model["layers"] * 2 * h
        head = n * r * h * vocab

        def causal(length: int) -> int:
            return length * (length + 1) // 2

        unshared = n * ((p + r) * per_position + causal(p + r) * per_pair) + head
        shared = (p + n * r) * per_position + (causal(p) + n * (r * p + causal(r))) * per_pair + head
        return unshared / shared


SHAPES = {
    # The seed's recipe is P:R about 8:1 (32K prompts, 4K responses, G=8); this CPU takes P=1K, R=128.
    "prompt-heavy": Shape(prompts_per_step=4, samples_per_prompt=8, prompt_tokens=1024, response_tokens=128),
    # R >= P: generation dominates and ZoRRo has little to share.
    "generation-heavy": Shape(prompts_per_step=4, samples_per_prompt=8, prompt_tokens=96, response_tokens=256),
}

MODEL = {"family": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "intermediate": 512,
         "vocab_size": 1024, "max_positions": 2048}
"""Large enough that the engines' compute, not their per-call overhead, dominates a step on two cores. The built-in
tokenizer corpus yields 567 tokens, which caps the vocabulary below `vocab_size`."""

SEED = 0
DATASET_PROMPTS = 64
"""Prompts in the training file; a run of S steps reads the first S x prompts_per_step, in order."""

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 for a response holding the answer's first digit: mixed rewards from a random model, so GRPO's groups
    have non-zero advantages."""
    return float(str(ground_truth)[0] in solution_str)
'''

_FILLER = ("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT);",
           "CREATE TABLE orders (id INTEGER, user_id INTEGER, price REAL, city TEXT);",
           "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
           "SELECT COUNT(*) FROM orders GROUP BY city;",
           "INSERT INTO orders VALUES (1, 'alice', 42.5);",
           "SELECT AVG(price) FROM items JOIN shops ON items.shop = shops.id;",
           "Which city has the most customers? How many orders were placed in 2024?",
           "The river flows through the valley. Paris is the capital of France.")


def question(index: int) -> tuple[str, str]:
    return f"what is {index} plus {index + 3}?", str(2 * index + 3)


def user_message(index: int, tokens: int, count_tokens) -> str:
    """A schema-and-examples context of about `tokens` tokens (as `count_tokens` counts the rendered prompt),
    then the question. Each prompt's context differs (its own seed), as each text-to-SQL task's schema does."""
    rng = random.Random(SEED * 100_003 + index)
    ask = question(index)[0]
    lines: list[str] = []
    while count_tokens("\n".join([*lines, ask])) < tokens:
        lines.append(rng.choice(_FILLER))
    while lines and count_tokens("\n".join([*lines, ask])) > tokens:  # the last line overshot: cut words
        words = lines[-1].split()
        lines[-1] = " ".join(words[:-1])
        if not lines[-1]:
            lines.pop()
    return "\n".join([*lines, ask])


def prompts(model: str, shape: Shape) -> tuple[list[tuple[str, str]], dict]:
    """The data set's (user message, answer) pairs, and the rendered prompts' token counts (the model's chat
    template with the generation prompt, as every framework renders them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def rendered(text: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))

    pairs = [(user_message(i, shape.prompt_tokens, rendered), question(i)[1]) for i in range(DATASET_PROMPTS)]
    lengths = [rendered(content) for content, _ in pairs]
    return pairs, {"prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths)}


def write_verl_dataset(folder: str, model: str, shape: Shape) -> dict:
    """train.parquet / val.parquet in verl's RL format and reward.py; returns the prompts' token counts."""
    import os

    import pandas as pd

    pairs, lengths = prompts(model, shape)
    rows = [{"data_source": "arctic_sql", "prompt": [{"role": "user", "content": content}], "ability": "sql",
             "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": i, "split": "train"}}
            for i, (content, answer) in enumerate(pairs)]
    pd.DataFrame(rows).to_parquet(os.path.join(folder, "train.parquet"))
    pd.DataFrame(rows[:4]).to_parquet(os.path.join(folder, "val.parquet"))
    with open(os.path.join(folder, "reward.py"), "w") as f:
        f.write(REWARD)
    return lengths


def report(result: dict, log: str, steps_wanted: int) -> int:
    """A runner's answer: its result as one JSON line on stdout (the orchestrator reads the last), with the log's tail
    as `error` where the run failed or logged fewer steps than asked; the exit status to return."""
    if result["returncode"] != 0 or len(result["steps"]) < steps_wanted:
        result["error"] = log[-4000:]
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


def runner_parser(description: str, columns: tuple[str, ...] = ("arctic",), dtypes: tuple[str, ...] = ("float32",)):
    """The command line `bench frameworks` gives every runner (bench.run_column); `dtypes`: those the runner's alone
    column can train in (bench.Framework.dtypes)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--column", choices=list(columns), required=True)
    parser.add_argument("--shape", required=True, help="workload.Shape as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True, help="an empty folder for this run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--url", required="alone" not in columns, help="the Arctic RL server (column arctic)")
    parser.add_argument("--dtype", choices=list(dtypes), default="float32",
                        help="the training compute's dtype (through Arctic RL, the server's job holds it)")
    parser.add_argument("--override", action="append", default=[], help="one more setting of the framework's (the "
                        "tuning)")
    return parser


def shape_json(shape: Shape) -> str:
    return json.dumps(asdict(shape))


def shape_from_json(text: str) -> Shape:
    return Shape(**json.loads(text))
