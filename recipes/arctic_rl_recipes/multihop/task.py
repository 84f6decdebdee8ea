"""Long-context multi-hop QA: HotpotQA, MuSiQue and 2WikiMultihopQA loaders, substring exact-match reward.

Every question's paragraphs (supporting and distractors, in the order the data
set gives them) are assembled into one long context.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import replace
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.data_files import read_json_records
from arctic_rl_recipes.multihop.distractors import DistractorConfig, Question, padded_prompts
from arctic_rl_recipes.multihop.prompt import Paragraph, build_prompt
from arctic_rl_recipes.multihop.synthetic import SyntheticQAConfig, generate_multihop
from arctic_rl_recipes.task import Example, Score, require_paths

Format = Literal["hotpotqa", "musique", "2wikimultihopqa"]
# Record keys each format must hold: (id, question, answer, paragraphs).
_FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "hotpotqa": ("_id", "question", "answer", "context"),
    "2wikimultihopqa": ("_id", "question", "answer", "context"),
    "musique": ("id", "question", "answer", "paragraphs"),
}
_ARTICLES = re.compile(r"\b(a|an|the)\b")


class MultihopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["multihop_qa"]
    format: Format = "hotpotqa"
    train: str | None = None
    eval: str | None = None
    max_paragraphs: int | None = Field(None, ge=1)
    """Keep at most this many paragraphs per question (all supporting ones, then the first distractors); default all."""
    distractors: DistractorConfig | None = None
    """The distractor variant: each context padded with other questions' paragraphs to `budget_tokens`, the
    supporting paragraphs at `needle_depth` (multihop/distractors.py); default the data set's own context."""
    synthetic: SyntheticQAConfig | None = None
    """Generate a synthetic set in HotpotQA format under the run's output folder and train on it."""


def normalize_answer(text: str) -> str:
    """SQuAD/HotpotQA normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def substring_match_reward(response: str, *, answers: list[str]) -> Score:
    """1 if any normalised gold answer occurs in the normalised response (as whole words), else 0."""
    predicted = f" {normalize_answer(response)} "
    correct = any(a and f" {a} " in predicted for a in (normalize_answer(x) for x in answers))
    return Score(float(correct), correct)


def _paragraphs(record: dict, fmt: str, where: str) -> list[Paragraph]:
    """(title, text, is_supporting) of each paragraph."""
    if fmt == "musique":
        out = []
        for j, p in enumerate(record["paragraphs"]):
            if not isinstance(p, dict) or "paragraph_text" not in p:
                raise InvalidRequest(f"{where}.paragraphs[{j}]", "must be an object with paragraph_text (MuSiQue format)")
            out.append((p.get("title", ""), p["paragraph_text"], bool(p.get("is_supporting"))))
        return out
    supporting = {title for title, *_ in record.get("supporting_facts", [])}
    out = []
    for j, item in enumerate(record["context"]):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], list)):
            raise InvalidRequest(f"{where}.context[{j}]", f"must be [title, [sentences...]] ({fmt} format)")
        title, sentences = item
        out.append((title, " ".join(s.strip() for s in sentences), title in supporting))
    return out


class MultihopTask:
    name = "multihop_qa"
    reward_fn = staticmethod(substring_match_reward)

    def __init__(self, config: MultihopConfig, output_dir: str):
        if config.synthetic is not None:
            paths = generate_multihop(os.path.join(output_dir, "data"), config.synthetic)
            config = config.model_copy(update={"format": "hotpotqa", **paths})
        require_paths(config, ("train", "eval"))
        self.config = config
        self._questions: dict[str, list[Question]] = {}

    def load(self, split: str) -> list[Example]:
        field = f"task.{split}"
        fmt = self.config.format
        records = read_json_records(getattr(self.config, split), field, _FORMAT_KEYS[fmt], fmt)
        examples, questions = [], []
        self._questions[split] = questions
        for i, record in enumerate(records):
            if fmt == "musique" and record.get("answerable") is False:
                continue  # MuSiQue-full's unanswerable questions have no answer to match
            paragraphs = _paragraphs(record, fmt, f"{field}[{i}]")
            if self.config.max_paragraphs is not None:
                # Keep the supporting paragraphs and the first distractors, in the data set's order.
                ranked = sorted(range(len(paragraphs)), key=lambda j: not paragraphs[j][2])
                keep = set(ranked[: self.config.max_paragraphs])
                paragraphs = [p for j, p in enumerate(paragraphs) if j in keep]
            answers = [record["answer"], *record.get("answer_aliases", [])]
            qid = str(record.get("_id", record.get("id", i)))
            questions.append(Question(qid, paragraphs, record["question"]))
            examples.append(Example(
                id=qid,
                prompt=build_prompt(paragraphs, record["question"]),
                reference=" " + record["answer"],
                reward_args={"answers": [str(a) for a in answers]},
            ))
        if not examples:
            raise InvalidRequest(field, "holds no answerable examples")
        return examples

    def fit_contexts(self, split: str, examples: list[Example], count_tokens: Callable[[str], int]) -> list[Example]:
        """With `distractors`: the loaded examples (of `split`, any subset) with their contexts padded to the
        token budget, distractors drawn from the whole split; without, as loaded."""
        if self.config.distractors is None:
            return examples
        questions = {q.id: q for q in self._questions[split]}
        prompts = padded_prompts([questions[e.id] for e in examples], count_tokens, self.config.distractors,
                                 pool=self._questions[split])
        return [replace(e, prompt=prompt) for e, prompt in zip(examples, prompts)]
