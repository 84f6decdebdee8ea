"""Trajectory capture: what the sampler saw and produced, per episode, for training without re-tokenising.

A generate call that names a session records each prompt's token ids and each
completion's token ids, log-probs and weight version as turns of that episode.
Episodes are kept until released; past the token budget the least recently
used are evicted (counted in `status`), so a harness that never collects its
episodes cannot exhaust the server's memory. A turn's routing record (router
replay) counts one token per expert id: it is layers x top-k times its tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from arctic_rl_core.errors import NotFound
from arctic_rl_core.types import Completion, Episode, Turn, token_list


class UnknownSession(NotFound):
    """The session was never recorded, or was released or evicted (HTTP 404)."""


class TrajectoryStore:
    def __init__(self, max_tokens: int = 64 * 2**20):
        self.max_tokens = max_tokens
        self._episodes: OrderedDict[str, list[Turn]] = OrderedDict()
        self._tokens: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        self.evicted = 0
        self.recorded_turns = 0

    def record(self, session: str, prompts: list, completions: list[Completion], cancelled: bool = False) -> None:
        """`cancelled`: the client went away before its answer; `completions` hold what it received."""
        turns = [Turn(prompt_ids=token_list(prompts[c.prompt_index]), token_ids=c.token_ids, logprobs=c.logprobs,
                      finish_reason=c.finish_reason, weight_version=c.weight_version, token_versions=c.token_versions,
                      routed_experts=c.routed_experts, cancelled=cancelled)
                 for c in completions]
        size = sum(len(t.prompt_ids) + len(t.token_ids) + (len(t.routed_experts.ids) if t.routed_experts else 0)
                   for t in turns)
        with self._lock:
            self._episodes.setdefault(session, []).extend(turns)
            self._episodes.move_to_end(session)
            self._tokens[session] = self._tokens.get(session, 0) + size
            self._total += size
            self.recorded_turns += len(turns)
            while self._total > self.max_tokens and len(self._episodes) > 1:
                oldest, _ = self._episodes.popitem(last=False)
                self._total -= self._tokens.pop(oldest)
                self.evicted += 1

    def episode(self, session: str, release: bool = False) -> Episode:
        with self._lock:
            turns = self._episodes.get(session)
            if turns is None:
                raise UnknownSession("session", f"no episode {session!r} is recorded (never sampled with this "
                                                "session id, released, or evicted past the capture budget)")
            episode = Episode(session=session, turns=list(turns))
            if release:
                del self._episodes[session]
                self._total -= self._tokens.pop(session)
        return episode

    def describe(self) -> dict:
        with self._lock:
            return {"episodes": len(self._episodes), "tokens": self._total, "recorded_turns": self.recorded_turns,
                    "evicted": self.evicted}
