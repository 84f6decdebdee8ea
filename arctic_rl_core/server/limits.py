"""How much work one request may ask of the server.

Each cap is a server setting (`arctic-rl serve --limit NAME=VALUE`); a request
over one is refused with 413 naming the field and the limit, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from arctic_rl_core.errors import InvalidRequest


class OverLimit(InvalidRequest):
    """The request asks for more work than the server allows (HTTP 413)."""


@dataclass
class RequestLimits:
    prompts_per_call: int = 4096
    samples_per_prompt: int = 256
    """`sampling.n`."""
    max_tokens: int = 32768
    """`sampling.max_tokens`."""
    stop_strings: int = 16
    stop_string_chars: int = 256
    generated_tokens_per_call: int = 4_194_304
    """prompts x n x max_tokens."""
    sequences_per_call: int = 16384
    """Sequences in one fwd_bwd or log_probs."""
    tokens_per_call: int = 16_777_216
    """Prompt + response tokens in one fwd_bwd, log_probs or generate call."""
    routed_expert_ids_per_call: int = 268_435_456
    """Expert ids of the sequences' routing records (router replay) in one fwd_bwd or log_probs call."""
    serving_body_bytes: int = 64 * 2**20
    """A body on the OpenAI- and vLLM-compatible routes: text to tokenize and render is work."""

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def check(self, route: str, query) -> None:
        if route == "generate":
            self._generate(query)
        elif route in ("fwd_bwd", "log_probs"):
            seqs = query.sequences
            self._cap("sequences", len(seqs), "sequences_per_call")
            self._cap("sequences", sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs), "tokens_per_call")
            self._cap("sequences", sum(len(s.routed_experts.ids) for s in seqs if s.routed_experts is not None),
                      "routed_expert_ids_per_call")

    def _generate(self, query) -> None:
        sampling = query.sampling
        self._cap("prompts", len(query.prompts), "prompts_per_call")
        self._cap("prompts", sum(map(len, query.prompts)), "tokens_per_call")
        self._cap("sampling.n", sampling.n, "samples_per_prompt")
        self._cap("sampling.max_tokens", sampling.max_tokens, "max_tokens")
        self._cap("sampling.stop", len(sampling.stop), "stop_strings")
        for i, stop in enumerate(sampling.stop):
            self._cap(f"sampling.stop[{i}]", len(stop), "stop_string_chars")
        self._cap("sampling", len(query.prompts) * sampling.n * sampling.max_tokens, "generated_tokens_per_call")

    def _cap(self, field: str, value: int, limit: str) -> None:
        cap = getattr(self, limit)
        if value > cap:
            raise OverLimit(field, f"{value} exceeds the server's limit {limit}={cap}")
