"""vLLM's /tokenize and /detokenize, `echo`, sampling controls over HTTP, and logprobs' real token bytes."""

from __future__ import annotations

import pytest

from tests.support.http import check_error, post
from tests.support.server import MODEL

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return tiny_server


async def test_tokenize_and_detokenize_round_trip(tiny):
    status, body, _ = await post(tiny.url, "/tokenize", {"model": MODEL, "prompt": "Hello world 你好"})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    status, back, _ = await post(tiny.url, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "Hello world 你好"
    status, chat, _ = await post(tiny.url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "return_token_strs": True})
    assert status == 200 and "<|im_start|>" in chat["token_strs"] and chat["count"] > 3
    status, err, _ = await post(tiny.url, "/detokenize", {"tokens": [10**9]})
    check_error(status, err, 400, "tokens")
    status, err, _ = await post(tiny.url, "/tokenize", {"model": "other", "prompt": "x"})
    check_error(status, err, 404, "model")


async def test_echo_and_controls_through_the_openai_client(tiny):
    async with openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="none", max_retries=0) as c:
        done = await c.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, echo=True)
        assert done.choices[0].text.startswith("Hello world") and len(done.choices[0].text) > len("Hello world")
        chunks = [ch.choices[0].text async for ch in await c.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, echo=True, stream=True)]
        assert "".join(chunks) == done.choices[0].text
        (paris,) = (await post(tiny.url, "/tokenize", {"prompt": " Paris", "add_special_tokens": False}))[1]["tokens"]
        forced = await c.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                            logit_bias={str(paris): 100}, extra_body={"ignore_eos": True})
        assert forced.choices[0].text == " Paris" * 6
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias={"999999": 5})
        assert info.value.body["param"] == "logit_bias"


async def test_chat_logprobs_carry_the_tokens_real_bytes(tiny):
    """An emoji split over byte tokens: each token's `bytes` are its own bytes, and they join to valid UTF-8."""
    async with openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="none", max_retries=0) as c:
        reply = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, logprobs=True,
            top_logprobs=2, extra_body={"structured_outputs": {"choice": ["😀🎉 ok"]}})
    content = reply.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content)  # the last token is the end-of-turn special token
    assert joined.decode().removesuffix("<|im_end|>") == reply.choices[0].message.content == "😀🎉 ok"
    assert any("\ufffd" in t.token for t in content), "the emoji should be split across byte tokens"
