"""What a recipe's task provides to the driver: examples, and a reward function.

A task turns a data set on disk (in its real published format) into `Example`s:
the prompt text, the reference response used for SFT, and the picklable
arguments its reward function needs. The reward function is a plain top-level
function so it can run in the reward process pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    reference: str
    """The gold response (SFT target)."""
    reward_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's reward function besides the response text."""


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool


class Task(Protocol):
    name: str
    reward_fn: Callable[..., Score]
    """`reward_fn(response: str, **example.reward_args) -> Score`; top-level, so it pickles."""

    def load(self, split: str) -> list[Example]:
        """The examples of split `train` or `eval`; raises `InvalidRequest` naming the bad field or file."""

    def corpus(self) -> list[str]:
        """Texts to train a tiny model's tokenizer on (built only when the recipe asks for a tiny model)."""
