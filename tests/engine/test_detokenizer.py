"""IncrementalDetokenizer: whole UTF-8 characters only, stop strings cut across token boundaries, never leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.service.engine.detokenizer import IncrementalDetokenizer
from tests.support.profiles import examples
from tests.support.tiny import tokenizer as tiny_tokenizer

TEXTS = ["你好 😀 café Paris", "日本語 ✓ ünïcödé 🎉🎉", "The capital of France is Paris."]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2 tokenizer (the session's download: byte-level BPE with merges the tiny one lacks)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


TOKENIZERS = [pytest.param("tiny", id="tiny-bpe"), pytest.param("smollm2", id="smollm2", marks=pytest.mark.slow)]


def feed(tok, ids, prompt=(), **kw):
    """Feed `ids` one token at a time; return (detokenizer, deltas)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas = [d.update([t]) for t in ids]
    return d, deltas


@pytest.fixture(params=TOKENIZERS)
def tok(request):
    return tiny_tokenizer() if request.param == "tiny" else request.getfixturevalue("smollm2_tokenizer")


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_split(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = feed(tok, ids, prompt=tok.encode("Hi:", add_special_tokens=False))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids) == d.text
    assert d.stop_hit is None


def test_split_bytes_are_held_then_released():
    tok = tiny_tokenizer()
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    d, deltas = feed(tok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_special_tokens_skipped(tok):
    ids = tok.encode("Paris", add_special_tokens=False) + [tok.eos_token_id]
    _, deltas = feed(tok, ids)
    assert "".join(deltas) == "Paris"
    d, deltas = feed(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "Paris" + tok.eos_token


def test_prompt_context_keeps_leading_space(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    ids = tok.encode(" Paris", add_special_tokens=False)
    _, deltas = feed(tok, ids, prompt=prompt)
    assert "".join(deltas) == " Paris"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_cut(tok, include):
    text = "The capital of France is Paris. Hello world"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "is Par"
    assert not any(stop in tok.decode([i]) for i in ids), "the stop string must span tokens"
    d, deltas = feed(tok, ids, stop=[stop], include_stop_str_in_output=include)
    want = text[: text.index(stop) + (len(stop) if include else 0)]
    assert "".join(deltas) == want == d.text
    assert d.stop_hit == stop
    if not include:
        assert all("P" not in x for x in deltas), "no piece of the stop string may leak"
    assert d.update(tok.encode(" more", add_special_tokens=False)) == ""


def test_hold_back_then_release_when_no_match(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    d, deltas = feed(tok, ids, stop=["world peace"])
    assert "".join(deltas) == "Hello "  # "world" could still become "world peace"
    assert d.text == "Hello world"
    assert d.update(tok.encode(" today", add_special_tokens=False)) == "world today"
    d2, deltas = feed(tok, ids, stop=["world peace"])
    assert d2.flush() == "world" and d2.stop_hit is None


def test_earliest_stop_wins(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    d, deltas = feed(tok, ids, stop=["four", "two", "xyz"])
    assert "".join(deltas) == "one " and d.stop_hit == "two"


def test_stop_at_first_character(tok):
    ids = tok.encode("Paris is nice", add_special_tokens=False)
    d, deltas = feed(tok, ids, stop=["Paris"])
    assert "".join(deltas) == "" and d.stop_hit == "Paris" and d.text == ""


def test_multibyte_stop_string(tok):
    text = "你好 😀 café Paris"
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = feed(tok, ids, stop=["😀 c"])
    assert "".join(deltas) == "你好 " and d.stop_hit == "😀 c"


def test_update_cost_does_not_grow_with_length():
    """O(new tokens): the decode window stays a few tokens long however long the output gets."""
    tok = tiny_tokenizer()
    calls = []
    real = tok.convert_tokens_to_string

    class Spy:
        all_special_ids = tok.all_special_ids
        convert_ids_to_tokens = staticmethod(tok.convert_ids_to_tokens)

        @staticmethod
        def convert_tokens_to_string(tokens):
            calls.append(len(tokens))
            return real(tokens)

    ids = tok.encode("The capital of France is Paris. " * 40, add_special_tokens=False)
    feed(Spy, ids, stop=["never appears here"])
    assert max(calls) <= 8


ALPHABET = "ab é你😀 "


@settings(max_examples=examples(200, 2000), deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=0, max_size=30),
    stop=st.text(alphabet=ALPHABET, min_size=1, max_size=4),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=40),
)
def test_property_stream_equals_cut_text(text, stop, include, chunks):
    tok = tiny_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    deltas, i, k = [], 0, 0
    while i < len(ids):  # feed in uneven chunks, like a request that sometimes gets several tokens
        n = chunks[k % len(chunks)]
        deltas.append(d.update(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(d.flush())
    full = tok.decode(ids)
    at = full.find(stop)
    want = full if at < 0 else full[: at + (len(stop) if include else 0)]
    assert "".join(deltas) == want == d.text
    assert d.stop_hit == (stop if at >= 0 else None)
    assert all("\ufffd" not in x for x in deltas)
