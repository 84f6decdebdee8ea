"""Text in and out of the served model: its tokenizer and chat template.

Prompts are rendered once, here, and the token ids the sampler saw are what a
captured episode records; text is only ever produced from sampled ids, never
turned back into ids for training.
"""

from __future__ import annotations

from typing import Any

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.types import Completion


_RENDERER_OPTIONS = frozenset({
    "chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "conversation", "processor_kwargs"})
"""`apply_chat_template`'s own parameters."""


class TextCodec:
    def __init__(self, model_path: str):
        from transformers import AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        """The tokens that end a reply unless `ignore_eos` (the tokenizer's and the generation config's, as vLLM's)."""


    def encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise InvalidRequest(field, "renders to no tokens")
        return list(ids)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None, **options) -> list[int]:
        """The prompt's token ids by the model's own chat template (`chat_text`)."""
        # The template writes any special tokens itself: tokenizing adds none.
        return self.encode(self.chat_text(messages, tools, add_generation_prompt, template_kwargs, **options),
                           add_special_tokens=False, field="messages")

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool,
                  template_kwargs: dict[str, Any] | None, continue_final_message: bool = False,
                  documents: list[dict[str, str]] | None = None) -> str:
        """The prompt's text by the model's own chat template; a list it cannot render is refused.
        `template_kwargs` reach the template as variables, never as options of the renderer (a request
        must not bring its own template)."""
        from jinja2 import TemplateError

        for key in template_kwargs or {}:
            if key in _RENDERER_OPTIONS:
                raise InvalidRequest(f"chat_template_kwargs.{key}", "is an option of the renderer, not a template variable")
        if not self.tokenizer.chat_template:
            raise InvalidRequest("messages", "the served model's tokenizer has no chat template; use /v1/completions")
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise InvalidRequest(f"messages[{i}].role", "every message needs a role")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("continue_final_message", "continues the last message: it needs "
                                                           "add_generation_prompt false")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final_message, **({"documents": documents} if documents else {}),
                **(template_kwargs or {}))
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise InvalidRequest("messages", f"the model's chat template cannot render them: {err}") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def without_special_tokens(self, text: str) -> str:
        special = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        for token in special | set(self.tokenizer.all_special_tokens):
            text = text.replace(token, "")
        return text.strip()

    def decode_stream(self, skip_special_tokens: bool):
        """A decoder fed one token at a time whose pieces join to `decode`'s text (tokenizers' `DecodeStream`, as
        vLLM's fast detokenizer), or None where they might not: a tokenizer without a Rust backend, or one that
        cleans up spaces after decoding (a whole-text step no token-by-token decoder repeats)."""
        from tokenizers.decoders import DecodeStream

        backend = getattr(self.tokenizer, "_tokenizer", None)
        if not getattr(self.tokenizer, "is_fast", False) or backend is None or \
                getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(backend, token_id)

    def token_text(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id])

    def finished_text(self, completion: Completion, stops: list[str], stop_token_ids: list[int],
                      include_stop: bool, skip_special_tokens: bool) -> tuple[str, int | str | None]:
        """The completion's text as vLLM's detokenizer writes it (the token ids keep every sampled token): cut
        before a stop string it ends with; without the stop token (EOS or one of `stop_token_ids`) that ended it;
        without a last character whose bytes never all came. And what stopped it: the stop string or token id,
        `repetition_detected`; None for EOS or length. `include_stop` keeps the stop string or token."""
        ids = completion.token_ids
        text = self.decode(ids, skip_special_tokens).rstrip("\ufffd")
        if completion.finish_reason == "repetition":  # vLLM's: the repeated tokens stay
            return text, "repetition_detected"
        if completion.finish_reason != "stop":
            return text, None
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:  # a stop token ended it
            if not include_stop and ids:
                text = self.decode(ids[:-1], skip_special_tokens).rstrip("\ufffd")
            return text, ids[-1] if ids and ids[-1] in stop_token_ids else None
        at, stop = min(hits)
        return (text[: at + len(stop)] if include_stop else text[:at]), stop


class StreamedText:
    """One choice's text as its tokens arrive: each `add` gives what may be sent now, never a stop string or the
    start of one, nor half a character; `rest` gives what the finished text adds to what was sent. Each token is
    decoded once where the tokenizer allows it (decoding the whole reply again per token is quadratic: a 4K-token
    stream would decode 8M tokens on the server's event loop)."""

    def __init__(self, codec: TextCodec, stops: list[str], skip_special_tokens: bool, stop_token_ids: list[int],
                 ignore_eos: bool, include_stop: bool):
        self.codec, self.stops, self.skip = codec, [s for s in stops if s], skip_special_tokens
        self.hold_back = max(map(len, self.stops), default=1) - 1
        self.stop_ids = frozenset() if include_stop else \
            frozenset(stop_token_ids) | (frozenset() if ignore_eos else codec.eos_ids)
        """Tokens that may end the reply, whose text it then leaves out (vLLM's detokenizer does; `include_stop`
        keeps it): a last token among them is not shown until another follows it."""
        self.ids: list[int] = []
        self.sent = ""
        self._step = codec.decode_stream(skip_special_tokens)
        self._decoded, self._fed = "", 0
        """The text of `ids[:_fed]`, where each token is decoded once."""

    def _text(self, shown: int) -> str:
        """The text of the first `shown` tokens, less a last character whose bytes are still to come."""
        if self._step is None:
            return self.codec.decode(self.ids[:shown], self.skip).rstrip("\ufffd")
        for token_id in self.ids[self._fed:shown]:
            self._decoded += self._step(token_id) or ""  # None: a character's bytes are still to come
        self._fed = shown
        return self._decoded

    def add(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self._text(len(self.ids) - 1 if self.ids and self.ids[-1] in self.stop_ids else len(self.ids))
        # No stop string starts in what was sent: `hold_back` kept back every start of one that had not all come.
        hits = [at for at in (text.find(s, len(self.sent)) for s in self.stops) if at >= 0]
        text = text[:min(hits)] if hits else text[:len(text) - self.hold_back]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def rest(self, finished: str) -> str:
        return finished[len(self.sent):] if finished.startswith(self.sent) else ""
