"""Log-probs in the shapes the routes answer with: OpenAI's chat and completions entries (vLLM's echo of the
prompt's included), and vLLM's token route's."""

from __future__ import annotations

from arctic_rl_core.serving.text import TextCodec
from arctic_rl_core.types import Completion


def _top(codec: TextCodec, pairs, as_id: bool) -> list[dict]:
    return [{"token": codec.token_text(t, as_id), "logprob": lp,
             "bytes": list(codec.token_text(t, False).encode())} for t, lp in pairs]


def chat_logprobs(codec: TextCodec, token_ids: list[int], logprobs: list[float], tops, as_id: bool) -> list[dict]:
    """OpenAI's chat log-prob entries of a reply's tokens (or a streamed piece's)."""
    tops = tops or [[] for _ in token_ids]
    return [{"token": codec.token_text(t, as_id), "logprob": lp, "bytes": list(codec.token_text(t, False).encode()),
             "top_logprobs": _top(codec, top, as_id)} for t, lp, top in zip(token_ids, logprobs, tops)]


def completion_logprobs(codec: TextCodec, token_ids: list[int], logprobs: list[float], tops, as_id: bool,
                         at: int = 0) -> dict:
    """OpenAI's completion log-probs of a reply's tokens (or of a streamed piece's, whose text starts at `at`)."""
    tokens = [codec.token_text(t, as_id) for t in token_ids]
    offsets = []
    for t in token_ids:
        offsets.append(at)
        at += len(codec.token_text(t, False))
    if tops is not None:
        tops = [{codec.token_text(t, as_id): lp for t, lp in [(tok, own)] + list(top)}
                for tok, own, top in zip(token_ids, logprobs, tops)]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(codec: TextCodec, prompt_ids: list[int], c: Completion, as_id: bool, reply: dict | None) -> dict:
    """vLLM's echoed completion log-probs: the prompt's (the first token's null, having no context), then the
    reply's (`reply`, None for the prompt alone), its text offsets after the prompt's."""
    scored = c.prompt_logprobs or []
    echoed = completion_logprobs(codec, prompt_ids[1:], [e[0][1] for e in scored], [e[1:] for e in scored], as_id,
                                  len(codec.token_text(prompt_ids[0], False)))
    first = codec.token_text(prompt_ids[0], as_id)
    out = {"tokens": [first] + echoed["tokens"], "token_logprobs": [None] + echoed["token_logprobs"],
           "top_logprobs": [None] + echoed["top_logprobs"], "text_offset": [0] + echoed["text_offset"]}
    if reply is None:
        return out
    at = out["text_offset"][-1] + len(codec.token_text(prompt_ids[-1], False))
    return {key: out[key] + (reply[key] if key != "text_offset" else [at + o for o in reply[key]]) for key in out}


def _ranked(entries) -> dict:
    """vLLM's `{token_id: Logprob}` for one prompt position: the token itself first, then the top k ranked."""
    own, top = entries[0], entries[1:]
    out = {}
    for rank, (t, lp) in enumerate(top, start=1):
        out[t] = {"logprob": lp, "rank": rank}
    out.setdefault(own[0], {"logprob": own[1], "rank": None})
    return out


def vllm_prompt_logprobs(c: Completion) -> list | None:
    if c.prompt_logprobs is None:
        return None
    return [None] + [_ranked(entries) for entries in c.prompt_logprobs]


def openai_prompt_logprobs(codec: TextCodec, c: Completion | None, prompt_ids: list[int]) -> list | None:
    if c is None or c.prompt_logprobs is None:
        return None
    return [None] + [{str(t): {**v, "decoded_token": codec.token_text(t, False)} for t, v in _ranked(e).items()}
                     for e in c.prompt_logprobs]


def token_logprobs(token_ids: list[int], logprobs: list[float], tops, ranks: list[int] | None) -> list[dict]:
    """vLLM's `GenerateLogProbsContent` (the sampled token's rank where the sampler reports it), with the `token`
    as "token_id:<id>" as PrimeRL's renderers client reads."""
    tops = tops or [[] for _ in token_ids]
    ranks = ranks or [None for _ in token_ids]
    return [{"token_id": t, "logprob": lp, "rank": rank or None, "token": f"token_id:{t}",
             "top_logprobs": [{"token_id": a, "logprob": b, "rank": r} for r, (a, b) in enumerate(top, start=1)]}
            for t, lp, top, rank in zip(token_ids, logprobs, tops, ranks)]
