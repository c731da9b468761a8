"""The preparation pool and the cheap checks that run before any tokenizer or template work."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from sluice.service.api.errors import RequestError
from sluice.service.api.preprocess import (
    MAX_BODY_DEPTH,
    Preprocessor,
    check_depth,
    load_body,
    max_token_bytes,
    param_path,
    refuse_if_longer_than_context,
)


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


def test_text_too_long_for_the_context_is_refused_by_its_size(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    widest = max_token_bytes(tok)
    assert widest >= max(len(t.encode()) for t in ("<|im_start|>", "<|endoftext|>"))
    # The bound is sound: no text of B bytes encodes to fewer than B / widest tokens.
    for text in ("Hello world " * 50, "你好世界" * 40, "<|im_start|><|im_end|>" * 30):
        assert len(tok.encode(text)) >= len(text.encode()) / widest
    refuse_if_longer_than_context(widest * 99, tok, 100, "prompt")  # 99 tokens + 1 may still fit
    with pytest.raises(RequestError) as e:
        refuse_if_longer_than_context(widest * 100 + 1, tok, 100, "prompt")
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


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
