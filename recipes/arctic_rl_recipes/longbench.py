"""LongBench v1's QA tasks as an evaluation, the way LongBench itself runs them.

- Data: LongBench's published JSON Lines, one `{task}.jsonl` per task (fields `input`, `context`, `answers`,
  `length`, `all_classes`, `_id`, ...), read from a folder; nothing is downloaded.
- Prompts: LongBench's own templates (its `config/dataset2prompt.json`) and generation lengths
  (`config/dataset2maxlen.json`); a prompt longer than the window is cut from the middle, half its tokens from
  each end (LongBench's `pred.py`: the instructions sit at both ends); optionally in the model's chat template.
- Decoding: greedy, on the job's sampler (an embedded backend, or a server at `--url`).
- Metric: LongBench's `qa_f1_score` (SQuAD normalisation, token-level F1), the best over a question's gold
  answers, averaged per task x100 and rounded to 2 places as its `eval.py` reports it; then the mean of the tasks.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.data_files import read_json_records
from arctic_rl_recipes.multihop.task import normalize_answer

_PASSAGES = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
             "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
             "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
_QASPER_RULE = ("as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
                "answered based on the information in the article, write \"unanswerable\". If the question is a yes/no "
                "question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.")
TEMPLATES = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
                   "question as concisely as you can, using a single phrase if possible. Do not provide any "
                   "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as "
                   "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
                   "{input}\n\nAnswer:",
    "qasper": f"You are given a scientific article and a question. Answer the question {_QASPER_RULE}\n\nArticle: "
              f"{{context}}\n\n Answer the question based on the above article {_QASPER_RULE}\n\nQuestion: "
              f"{{input}}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
                       "based on the above text, only give me the answer and do not output any other words.\n\n"
                       "Question: {input}\nAnswer:",
    "hotpotqa": _PASSAGES,
    "2wikimqa": _PASSAGES,
    "musique": _PASSAGES,
}
"""LongBench v1's prompt templates of its English QA tasks (the tasks scored by QA F1)."""
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                  "musique": 32}
MULTI_HOP = ("hotpotqa", "2wikimqa", "musique")


def qa_f1(prediction: str, truth: str) -> float:
    """LongBench's `qa_f1_score`: F1 of the normalised answers' word multisets."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    same = sum((Counter(predicted) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def task_score(predictions: list[str], answers: list[list[str]]) -> float:
    """LongBench's per-task score: each prediction's best F1 over its gold answers, averaged, x100, 2 places."""
    best = [max((qa_f1(p, a) for a in golds), default=0.0) for p, golds in zip(predictions, answers, strict=True)]
    return round(100 * sum(best) / len(best), 2)


def load_task(folder: str, task: str, max_examples: int | None = None) -> list[dict]:
    """`folder/{task}.jsonl`'s records, each checked for the fields the evaluation reads."""
    if task not in TEMPLATES:
        raise InvalidRequest("tasks", f"{task!r} is not one of LongBench's QA tasks: {', '.join(TEMPLATES)}")
    path = os.path.join(folder, f"{task}.jsonl")
    records = read_json_records(path, f"data/{task}.jsonl", ("input", "context", "answers"), "LongBench")
    for i, record in enumerate(records):
        for name in ("input", "context"):
            if not isinstance(record[name], str):
                raise InvalidRequest(f"data/{task}.jsonl[{i}].{name}", "must be a string")
        answers = record["answers"]
        if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)):
            raise InvalidRequest(f"data/{task}.jsonl[{i}].answers", "must be a non-empty list of strings")
    return records[:max_examples]


def prompt_ids(record: dict, task: str, tokenizer, max_length: int, chat: bool) -> list[int]:
    """The record's prompt in the task's template, cut from the middle to `max_length` tokens, as token ids."""
    text = TEMPLATES[task].format(context=record["context"], input=record["input"])
    ids = tokenizer(text).input_ids
    if len(ids) > max_length:
        half = max_length // 2
        text = (tokenizer.decode(ids[:half], skip_special_tokens=True)
                + tokenizer.decode(ids[-half:], skip_special_tokens=True))
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(text).input_ids


@dataclass
class TaskResult:
    task: str
    examples: int
    f1: float
    predictions: list[dict]
    """LongBench's prediction rows: pred, answers, all_classes, length."""


def evaluate(api, tokenizer, folder: str, tasks: list[str], *, max_length: int, chat: bool = False,
             max_examples: int | None = None) -> list[TaskResult]:
    """Each task's predictions (greedy, on `api`'s sampler) and score."""
    from arctic_rl_core.types import SamplingParams

    results = []
    for task in tasks:
        records = load_task(folder, task, max_examples)
        prompts = [prompt_ids(r, task, tokenizer, max_length, chat) for r in records]
        completions = api.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS[task]))
        texts = [""] * len(records)
        for c in completions:
            texts[c.prompt_index] = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        rows = [{"pred": text, "answers": r["answers"], "all_classes": r.get("all_classes"), "length": r.get("length")}
                for text, r in zip(texts, records)]
        results.append(TaskResult(task, len(records), task_score(texts, [r["answers"] for r in records]), rows))
    return results


def table(results: list[TaskResult]) -> str:
    lines = [f"{'task':<16} {'examples':>8} {'QA F1':>7}"]
    lines += [f"{r.task:<16} {r.examples:>8} {r.f1:>7.2f}" for r in results]
    lines.append(f"{'average':<16} {sum(r.examples for r in results):>8} {average(results):>7.2f}")
    return "\n".join(lines)


def average(results: list[TaskResult]) -> float:
    """The mean of the tasks' scores (LongBench averages tasks, not examples)."""
    return round(sum(r.f1 for r in results) / len(results), 2)


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="folder with LongBench's {task}.jsonl files")
    p.add_argument("--model", help="model folder: an embedded backend on it, or with --url where its tokenizer is read")
    p.add_argument("--url", help="an arctic-rl serve to evaluate on, its job's model (ARCTIC_RL_TOKEN off loopback)")
    p.add_argument("--tasks", nargs="+", default=list(MULTI_HOP), choices=list(TEMPLATES),
                   help="default: the multi-hop ones (hotpotqa 2wikimqa musique)")
    p.add_argument("--sampler", default="vllm", help="the embedded backend's sampler (vllm, transformers)")
    p.add_argument("--rope-scaling", type=json.loads, default=None, metavar="JSON",
                   help='the embedded backend\'s RoPE scaling, e.g. \'{"rope_type": "yarn", "factor": 4, '
                        '"original_max_position_embeddings": 32768}\' (a server applies its job\'s)')
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt tokens kept (cut from the middle); default: the sampler's context less the task's answer")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-examples", type=int, default=None, help="the first N of each task")
    p.add_argument("--output", help="write the scores and LongBench's prediction rows here (JSON)")


def main(args) -> int:
    from transformers import AutoTokenizer

    if args.model is None and args.url is None:
        raise SystemExit("arctic-rl eval longbench: give --model, --url or both")
    if args.url is not None:
        from arctic_rl_core.client import ArcticRLClient

        api = ArcticRLClient(args.url, token=os.environ.get("ARCTIC_RL_TOKEN"))
        status = api.status()
        if not status["initialized"]:
            raise SystemExit(f"arctic-rl eval longbench: the server at {args.url} has no job")
        model, context = args.model or status["config"]["model_path"], status["backend"]["max_context"]
    else:
        from arctic_rl_core.backend import InProcessBackend

        api = InProcessBackend({"model_path": args.model, "rope_scaling": args.rope_scaling,
                                "sampler": {"name": args.sampler}})
        model, context = args.model, api.sampler.max_context
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        longest_answer = max(MAX_NEW_TOKENS[t] for t in args.tasks)
        max_length = args.max_length or context - longest_answer
        if max_length < 2 or max_length + longest_answer > context:
            raise SystemExit(f"--max-length {max_length} + {longest_answer} answer tokens exceed the context {context}")
        results = evaluate(api, tokenizer, args.data, args.tasks, max_length=max_length, chat=args.chat,
                           max_examples=args.max_examples)
    finally:
        if args.url is None:
            api.close()
    print(table(results))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"average": average(results), "max_length": max_length, "context": context,
                       "tasks": {r.task: {"f1": r.f1, "examples": r.examples, "predictions": r.predictions}
                                 for r in results}}, f, ensure_ascii=False, indent=1)
    return 0
