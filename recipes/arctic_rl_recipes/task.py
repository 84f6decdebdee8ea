"""What a recipe's task provides to the driver: examples, and a reward function.

A task turns a data set on disk (in its real published format) into `Example`s:
the prompt text, the reference response used for SFT, and the picklable
arguments its reward function needs. The reward function is a plain top-level
function so it can run in the reward process pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from arctic_rl_core.errors import InvalidRequest


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
        """The examples of split `train` or `eval`; raises `InvalidRequest` naming the bad field or file.

        A task whose prompts are sized in tokens also has `fit_contexts(split, examples, count_tokens)`, which
        the driver calls with the model's tokenizer once it is known (a tiny model's is trained on the loaded
        examples)."""


def require_paths(config, names: tuple[str, ...]) -> None:
    """Each of `task.<name>` must be set, unless the task generates a synthetic set."""
    for name in names:
        if getattr(config, name) is None:
            raise InvalidRequest(f"task.{name}", "is required (or set task.synthetic to generate a data set)")
