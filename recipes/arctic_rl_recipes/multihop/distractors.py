"""The distractor variants of the long-context recipe: each question's context padded to a token budget.

A question keeps its own paragraphs (the supporting ones, the needle, and its data set's distractors); paragraphs
of other questions of the split are drawn until the prompt reaches the budget, the last one cut short if
whole paragraphs leave a gap. The needle (the supporting paragraphs, in their order) sits at a chosen depth of
the context or at a random one. Everything drawn is decided by the seed and the question's id alone, so a run
rebuilds the same contexts.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from arctic_rl_recipes.multihop.prompt import Paragraph, build_prompt, document_line

TOLERANCE = 0.02
"""A built prompt is within this fraction under the budget, never over it."""


class DistractorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_tokens: int = Field(ge=64)
    """Tokens of each prompt (context, question and template), e.g. 4096, 8192 or 16384."""
    needle_depth: float | None = Field(None, ge=0, le=1)
    """Where the supporting paragraphs sit: 0 first, 1 last; default a random depth per question."""
    seed: int = 0


@dataclass(frozen=True)
class Question:
    id: str
    paragraphs: list[Paragraph]
    question: str


def padded_prompts(questions: list[Question], count_tokens: Callable[[str], int], config: DistractorConfig,
                   pool: list[Question] | None = None) -> list[str]:
    """Each question's prompt at `config.budget_tokens` (within TOLERANCE under it), distractors drawn from the
    paragraphs of `pool` (default: the questions themselves). A question whose own supporting paragraphs already
    exceed the budget keeps only those (the driver then drops it as too long)."""
    pool = [(title, text, False) for q in (pool or questions) for title, text, _ in q.paragraphs]
    line_tokens: dict[Paragraph, int] = {}

    def estimate(paragraph: Paragraph) -> int:
        if paragraph not in line_tokens:
            line_tokens[paragraph] = count_tokens(document_line(10, paragraph[0], paragraph[1]) + "\n")
        return line_tokens[paragraph]

    return [_padded(q, pool, count_tokens, estimate, config) for q in questions]


def _padded(q: Question, pool: list[Paragraph], count_tokens, estimate, config: DistractorConfig) -> str:
    rng = random.Random(f"{config.seed}:{q.id}")
    needle = [p for p in q.paragraphs if p[2]]
    own_titles = {title for title, _, _ in q.paragraphs}
    # Its own distractors first, then others' paragraphs in a random order (none on a title it has).
    candidates = itertools.chain((p for p in q.paragraphs if not p[2]),
                                 (pool[i] for i in _random_order(rng, len(pool)) if pool[i][0] not in own_titles))
    depth = rng.random() if config.needle_depth is None else config.needle_depth
    budget, floor = config.budget_tokens, math.ceil(config.budget_tokens * (1 - TOLERANCE))

    def prompt(haystack: list[Paragraph]) -> str:
        at = round(depth * len(haystack))
        return build_prompt(haystack[:at] + needle + haystack[at:], q.question)

    # Paragraphs are added by their own lines' counts plus `bias`, then the prompt is counted exactly: a line
    # costs a token or two more in place (its document number's digits, its boundary with a neighbour). The bias
    # is learnt from each exact count, so a 16K-token context settles in two or three counts, not one a paragraph.
    haystack: list[Paragraph] = []
    base = used = count_tokens(prompt(haystack))
    bias, spare, exhausted = 0.0, None, False
    middle = (floor + budget) / 2
    for _ in range(8):  # a round: grow to the band's middle by estimates, count, shrink by estimates if over
        estimated, grown = base + sum(estimate(p) + bias for p in haystack), False
        while not exhausted and estimated < middle:
            paragraph = next(candidates, None)
            if paragraph is None:
                exhausted = True
            elif estimated + estimate(paragraph) + bias <= middle:
                haystack.append(paragraph)
                estimated += estimate(paragraph) + bias
                grown = True
            else:
                spare = spare or paragraph  # too long whole: the one to cut if whole paragraphs leave a gap
                break
        used = count_tokens(prompt(haystack))
        if haystack:
            bias = (used - base - sum(estimate(p) for p in haystack)) / len(haystack)
        while used > budget:
            over = used - middle
            while over > 0 and haystack:
                over -= estimate(haystack[-1]) + bias
                candidates = itertools.chain([haystack.pop()], candidates)
            used = count_tokens(prompt(haystack))
        if used >= floor or exhausted or not grown:
            break
    if used < floor and (spare := spare or next(candidates, None)) is not None:
        # Cut at a character, not a word: a word can be several tokens, more than the 2% of a short budget.
        keep = _prefix_within(spare, budget - used - math.ceil(max(bias, 0)), estimate)
        while keep:
            cut = haystack + [(spare[0], spare[1][:keep], False)]
            if count_tokens(prompt(cut)) <= budget:
                haystack = cut
                break
            keep = _prefix_within(spare, estimate((spare[0], spare[1][:keep], False)) - 2, estimate)  # over: less
    return prompt(haystack)


def _random_order(rng: random.Random, n: int):
    """0..n-1 in a random order, drawn lazily: a question needs a few hundred of a split's paragraphs."""
    seen: set[int] = set()
    while len(seen) < n:
        i = rng.randrange(n)
        if i not in seen:
            seen.add(i)
            yield i


def _prefix_within(paragraph: Paragraph, room: int, estimate) -> int:
    """The longest prefix of the paragraph's text whose document line takes at most `room` tokens."""
    title, text, _ = paragraph
    low, high = 0, len(text)
    while low < high:
        mid = (low + high + 1) // 2
        if estimate((title, text[:mid], False)) <= room:
            low = mid
        else:
            high = mid - 1
    return low
