"""A stream's text, decoded a token at a time, against the plain path that decodes the whole reply per token."""

import random

import pytest

from arctic_rl_core.models.tiny import train_tokenizer
from arctic_rl_core.serving.text import StreamedText, TextCodec

CORPUS = ["naïve café déjà vu", "日本語のテキスト", "emoji 🎉🚀 and ünïcödé", "SELECT name FROM users;",
          "plain ascii words here"] * 20


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(400, CORPUS).save_pretrained(str(path))
    return TextCodec(str(path))


class PlainCodec:
    """The same tokenizer without a token-at-a-time decoder: StreamedText's reference path."""

    def __init__(self, codec):
        self.codec = codec
        self.eos_ids = codec.eos_ids

    def decode(self, ids, skip_special_tokens=True):
        return self.codec.decode(ids, skip_special_tokens)

    def decode_stream(self, skip_special_tokens):
        return None


def _pieces(codec, ids, chunks, **settings):
    text = StreamedText(codec, **settings)
    pieces, at = [], 0
    for size in chunks:
        pieces.append(text.add(ids[at:at + size]))
        at += size
    return pieces, text


def test_the_codec_has_a_token_at_a_time_decoder_for_a_fast_tokenizer(codec):
    assert codec.decode_stream(True) is not None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("stops", [[], ["é"], ["ab", "\n", "SELECT"]])
@pytest.mark.parametrize("random_ids", [False, True])
def test_pieces_add_up_to_the_plain_paths_text_and_are_the_same_pieces_for_text_that_is_utf8(
        codec, stops, skip_special_tokens, random_ids):
    """Real text has its characters split over byte-level tokens; random ids add bytes that are no UTF-8 at all,
    whose replacement characters the token-at-a-time decoder (as vLLM's) sends once what follows has come, the plain
    path at once: there the pieces may differ, never what was sent so far beyond a prefix, nor the whole."""
    rng = random.Random(0)
    eos = next(iter(codec.eos_ids))
    sampled = [codec.encode(line, False, "t") for line in CORPUS[:5]]
    for trial in range(60):
        ids = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(sampled)]
        if random_ids:
            at = rng.randrange(len(ids))
            ids[at:at] = [rng.randrange(len(codec.tokenizer)) for _ in range(5)]
        if trial % 3 == 0:
            ids.append(eos)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 1, 2, 5])))
            left -= chunks[-1]
        settings = dict(stops=stops, skip_special_tokens=skip_special_tokens, stop_token_ids=[], ignore_eos=False,
                        include_stop=False)
        fast, fast_text = _pieces(codec, ids, chunks, **settings)
        plain, plain_text = _pieces(PlainCodec(codec), ids, chunks, **settings)
        finished = codec.decode(ids, skip_special_tokens)
        assert "".join(fast) + fast_text.rest(finished) == "".join(plain) + plain_text.rest(finished), ids
        if random_ids:
            for k in range(len(chunks)):
                assert "".join(plain[:k]).startswith("".join(fast[:k])), ids
        else:
            assert fast == plain, ids


def test_a_long_reply_is_decoded_once_per_token_not_once_per_piece(codec, monkeypatch):
    ids = codec.encode(" ".join(CORPUS), False, "t")
    assert len(ids) > 300
    whole = []
    monkeypatch.setattr(codec, "decode", lambda *a, **k: whole.append(a) or "")
    text = StreamedText(codec, [], True, [], True, False)
    streamed = "".join(text.add([t]) for t in ids)
    assert whole == []  # the whole reply was never decoded again
    assert streamed == TextCodec.decode(codec, ids).rstrip("\ufffd")
