"""The preparation pool and the cheap checks that run before any tokenizer or template work."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from sluice.service.api.errors import RequestError
from sluice.service.api.preprocess import (
    MAX_BODY_DEPTH,
    Preprocessor,
    check_depth,
    load_body,
    max_token_bytes,
    param_path,
    prompt_bound,
    refuse_if_longer_than_context,
)
from tests.support.profiles import examples


def deep(depth: int, leaf="x"):
    node = leaf
    for _ in range(depth):
        node = {"a": [node]}
    return node


def test_depth_is_checked_without_recursion_and_names_the_parameter():
    check_depth({"tools": deep(10)}, 21)
    with pytest.raises(RequestError) as e:
        check_depth({"tools": [{"function": {"parameters": deep(20_000)}}]}, 64)  # recursion would overflow
    assert e.value.param == "tools[0].function.parameters" and e.value.status == 400


def test_a_body_deeper_than_the_limit_is_a_400_and_orjsons_own_limit_too():
    load_body(json.dumps({"metadata": deep(MAX_BODY_DEPTH // 2 - 1)}).encode())
    with pytest.raises(RequestError, match="nested more than"):
        load_body(json.dumps({"metadata": deep(MAX_BODY_DEPTH // 2 + 1)}).encode())
    with pytest.raises(RequestError, match="nested more than"):
        load_body(b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    with pytest.raises(RequestError, match="not valid JSON"):
        load_body(b'{"messages": [}')
    with pytest.raises(RequestError, match="must be a JSON object"):
        load_body(b"[1]")


def test_param_path():
    assert param_path(("messages", 3, "content")) == "messages[3].content"
    assert param_path(()) == ""


# Pieces the random texts are made of: the runs the widest tokens cover (SmolLM2's is a newline and 80 spaces), the
# specials, CJK and emoji, decomposed Hangul (a normalizer composes it) and anything hypothesis makes up.
PIECES = st.one_of(
    st.builds(str.__mul__, st.sampled_from([" ", "\n", "\t", "#", "=", "-", "*", "\r\n", "ab", "0"]),
              st.integers(1, 200)),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<jupyter_output>", "Hello world", " the",
                     "你好世界", "😀🎉", "café", "\u1100\u1161", "e\u0301", "<0x41>", "\u3000", "\xa0"]),
    st.text(max_size=20),
)
TEXTS = st.lists(PIECES, max_size=30).map("".join)


def assert_sound(tok, text: str) -> None:
    """No encoding of `text` is shorter than the bound says it must be."""
    num_bytes, least = prompt_bound(tok).measure(text)
    assert num_bytes == len(text.encode()) and len(tok.encode(text, add_special_tokens=False)) >= least, text


@pytest.fixture(scope="module")
def tiny_tok():
    from tests.support.tiny import tokenizer

    return tokenizer()


def fast(tokenizer_object, **specials):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **specials)


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A SentencePiece-style BPE (Llama 2, Mistral): "▁" for spaces, byte fallback, an NFC normalizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from tests.support.tiny import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return fast(Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_bound_counts_what_a_byte_level_token_really_covers(tiny_tok):
    bound = prompt_bound(tiny_tok)
    assert max_token_bytes(tiny_tok) == bound.widest
    display = max(len(t.encode()) for t in tiny_tok.convert_ids_to_tokens(list(range(len(tiny_tok)))))
    assert bound.widest >= len("<|im_start|>") and bound.widest < display  # "Ġ" is one byte, not two
    widest = max(tiny_tok.get_vocab(), key=lambda t: len(t.encode()) if t.startswith("Ġ") else 0)
    text = tiny_tok.convert_tokens_to_string([widest])  # a space and a word: as many tokens as it is long
    assert bound.measure(text * 50)[1] <= len(tiny_tok.encode(text * 50)) == 50
    for text in ("Hello world " * 50, "你好世界" * 40, "<|im_start|><|im_end|>" * 30):
        assert_sound(tiny_tok, text)


@settings(max_examples=examples(300, 3000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_the_bound_is_sound_for_byte_level_bpe(tiny_tok, text):
    assert_sound(tiny_tok, text)


@settings(max_examples=examples(300, 3000), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_the_bound_is_sound_for_sentencepiece_with_byte_fallback_and_a_normalizer(sentencepiece_tok, text):
    assert_sound(sentencepiece_tok, text)


def test_normalized_text_is_what_is_measured(sentencepiece_tok):
    jamo = "\u1100\u1161" * 1000  # 6,000 bytes that NFC composes into 1,000 syllables of 3
    bound = prompt_bound(sentencepiece_tok)
    assert bound.normalizer is not None and bound.widest >= len("<0x41>")
    assert bound.measure(jamo) == (6000, -(-3003 // bound.widest))  # "▁" prepended: 3,003 bytes
    assert len(sentencepiece_tok.encode(jamo)) >= bound.measure(jamo)[1]
    refuse_if_longer_than_context(jamo, sentencepiece_tok, 1002, "prompt")  # its bytes alone would prove 1,500


def test_tokens_of_any_length_turn_the_pre_check_off(tiny_tok):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    word = "b" * 1000  # one [UNK]
    assert len(fast(wordpiece, unk_token="[UNK]").encode(word)) == 1
    assert prompt_bound(fast(wordpiece, unk_token="[UNK]")).measure(word) == (1000, 0)
    refuse_if_longer_than_context(word, fast(wordpiece, unk_token="[UNK]"), 2, "prompt")
    # a byte-level tokenizer whose added token strips takes in any run of whitespace beside it: spaces weigh 0
    stripping = Tokenizer.from_str(tiny_tok.backend_tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True)])
    stripping = fast(stripping)
    text = " " * 500 + "<mask>" + " " * 500
    assert len(stripping.encode(text)) == 1 and prompt_bound(stripping).measure(text)[1] <= 1
    assert prompt_bound(stripping).measure("Hello world" * 100)[1] > 0


def test_text_too_long_for_the_context_is_refused_by_its_size(tiny_tok):
    bound = prompt_bound(tiny_tok)
    refuse_if_longer_than_context("Hello world", tiny_tok, 100, "prompt")
    with pytest.raises(RequestError) as e:  # whatever it covers, no token is wider than `widest`
        refuse_if_longer_than_context("x" * (bound.widest * 100), tiny_tok, 100, "prompt")
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    text = "Hello world " * 2000
    least = bound.measure(text)[1]
    assert least > -(-len(text) // bound.widest)  # the text itself proves more than its length does
    refuse_if_longer_than_context(text, tiny_tok, least + 1, "messages")
    with pytest.raises(RequestError,
                       match=f"the {len(text)} bytes of text in your messages are at least {least} tokens"):
        refuse_if_longer_than_context(text, tiny_tok, least, "messages")


@pytest.mark.slow
def test_smollm2s_widest_token_and_a_megabyte(smollm2_dir):
    """SmolLM2's widest token is a newline and 80 spaces (81 bytes, 162 in its display form): a megabyte of any text
    is more than its 8,192-token context, and the bound is sound on its vocabulary too."""
    from hypothesis import find
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    bound = prompt_bound(tok)
    assert bound.widest == 81
    for text in (" " * 1_000_000, "\n" + " " * 999_999, "word " * 200_000, "#" * 1_000_000):
        assert bound.measure(text)[1] > 8192
    run = "\n" + " " * 80
    assert len(tok.encode(run * 100)) == 100 == bound.measure(run * 100)[1]  # the bound is tight on it
    with pytest.raises(NoSuchExample):  # no random text encodes shorter than the bound
        find(TEXTS, lambda text: len(tok.encode(text, add_special_tokens=False)) < bound.measure(text)[1],
             settings=settings(max_examples=examples(500, 5000), deadline=None, database=None,
                               suppress_health_check=list(HealthCheck)))


def test_the_pool_is_bounded_and_runs_at_a_lower_priority():
    async def main():
        pool = Preprocessor(max_workers=1, max_pending=2, niceness=3)
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run(gate.wait, 5))
        second = asyncio.ensure_future(pool.run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestError) as e:
            await pool.run(time.sleep, 0)
        assert e.value.status == 429
        gate.set()
        assert await first is True
        assert await second == os.getpriority(os.PRIO_PROCESS, 0) + 3 or await second == 19
        assert await pool.run(sum, [1, 2]) == 3  # room again once the queue drained
        pool.shutdown()

    asyncio.run(main())
