"""Reasoning models end to end: `sluice serve --reasoning-parser auto` on a tiny Qwen3-shaped model whose chat
template has a `<think>` block, through the official `openai` client.

Random weights never write tags, so the model is built to: its layers add nothing (o_proj and down_proj are
zero) and its output head maps each token of one chain to the next, so greedy decoding after the generation
prompt writes `<think>Hello world</think>Paris` and stops. With `enable_thinking: false` the template closes the
thinking in the prompt and the chain resumes after `</think>`: the reply is `Paris`, all content."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from tests.support.http import stream_chat
from tests.support.server import MODEL, Server, wait_idle

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if note is defined %}{{ note }}\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)
REASONING, ANSWER = "Hello world", "Paris"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
                 "additionalProperties": False}


def save_thinking_model(path: str) -> str:
    """A tiny Qwen3 whose greedy reply to any chat prompt is `<think>Hello world</think>Paris<|im_end|>`."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.support.tiny import tokenizer

    tokenizer().save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # a copy: the shared test tokenizer stays as it is
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    chain = [*ids("\n"), *ids("<think>"), *ids(REASONING), *ids("</think>"), *ids(ANSWER), tok.eos_token_id]
    assert len(set(chain)) == len(chain), chain  # a bigram chain: each token has one successor
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the token's embedding, unchanged
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_()
        head = model.lm_head.weight
        head.normal_(std=0.01)
        for a, b in itertools.pairwise(chain):  # logit of b after a: 5 * sqrt(64) = 40; any other: a few units
            head[b] += 5 * emb[a] / emb[a].norm()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_thinking_model(str(tmp_path_factory.mktemp("thinking-model")))


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    server = Server(model_path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64", "--reasoning-parser", "auto")
    yield server.wait_ready()
    server.stop()


def post(srv, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def extra(obj, name: str):
    """A field the openai models do not declare (reasoning_content, reasoning)."""
    return (obj.model_extra or {}).get(name)


async def collect(c, **kwargs) -> tuple[str, str, str | None, list]:
    """A streamed reply's (reasoning, content, finish_reason, chunks); every delta names its thinking twice."""
    out = await stream_chat(c, **kwargs)
    for chunk in out.chunks:
        for choice in chunk.choices:
            assert extra(choice.delta, "reasoning_content") == extra(choice.delta, "reasoning")
    return out.reasoning, out.content, out.finish, out.chunks


async def test_the_thinking_is_reasoning_content_streamed_and_not(srv):
    async with client(srv) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
        msg = reply.choices[0].message
        assert (extra(msg, "reasoning_content"), msg.content) == (REASONING, ANSWER)
        assert extra(msg, "reasoning") == REASONING and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # <think> Hello world </think>
        reasoning, content, finish, chunks = await collect(
            c, model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20, stream_options={"include_usage": True})
        assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 5
        assert not any(extra(ch.choices[0].delta, "reasoning_content") and ch.choices[0].delta.content
                       for ch in chunks if ch.choices)  # thinking and answer never share a delta
    await wait_idle(srv)


async def test_max_tokens_counts_the_thinking(srv):
    async with client(srv) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
        msg = reply.choices[0].message
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
        assert extra(msg, "reasoning_content") == "Hello" and not msg.content  # cut inside the thinking
        reasoning, content, finish, _ = await collect(c, model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
        assert (reasoning, content, finish) == ("Hello", "", "length")


async def test_chat_template_kwargs_reach_the_template(srv):
    async with client(srv) as c:
        base = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
        off = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # the prompt closed the thinking: the chain resumed after </think>, and all of it is the answer
        assert (off.choices[0].message.content, extra(off.choices[0].message, "reasoning_content")) == (ANSWER, None)
        assert off.usage.prompt_tokens == base.usage.prompt_tokens + 2  # <think></think>
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        noted = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=1,
                                                extra_body={"chat_template_kwargs": {"note": "you are terse"}})
        assert noted.usage.prompt_tokens > base.usage.prompt_tokens  # the template printed the kwarg
        tokens = post(srv, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})
        assert tokens["count"] == off.usage.prompt_tokens  # /tokenize renders them too
        for bad, param in [({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                           ([1], "chat_template_kwargs")]:
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                extra_body={"chat_template_kwargs": bad})
            assert info.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_holds_only_after_the_thinking(srv, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA, "strict": True}}
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30, response_format=fmt)
    async with client(srv) as c:
        if stream:
            reasoning, content, finish, _ = await collect(c, **kwargs)
        else:
            reply = await c.chat.completions.create(**kwargs)
            msg = reply.choices[0].message
            reasoning, content, finish = extra(msg, "reasoning_content"), msg.content, reply.choices[0].finish_reason
    # Held from the first token, the grammar would have refused `<think>` and `Hello`: the free thinking shows
    # it waited; the answer, which the model would have written as `Paris`, is the schema's.
    assert reasoning == REASONING and finish == "stop"
    assert json.loads(content)["answer"] in ("yes", "no")
    await wait_idle(srv)


async def test_a_forced_tool_call_follows_the_thinking(srv):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}
    async with client(srv) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=100,
                                                tools=[tool], tool_choice="required", parallel_tool_calls=False)
    msg = reply.choices[0].message
    assert extra(msg, "reasoning_content") == REASONING and reply.choices[0].finish_reason == "tool_calls", reply
    calls = msg.tool_calls if isinstance(msg.tool_calls, list) else []
    assert [call.function.name for call in calls] == ["lookup"], msg
    assert isinstance(json.loads(calls[0].function.arguments)["ok"], bool)


async def test_a_reply_that_does_not_open_the_thinking_is_constrained_from_its_first_token(srv):
    """qwen3: `<think>` is offered beside the grammar's first tokens; a reply that starts otherwise is the
    grammar's from there (here `<think>` is banned by logit_bias), and all of it is content."""
    think = post(srv, "/tokenize", {"prompt": "<think>", "add_special_tokens": False})["tokens"]
    assert len(think) == 1
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    async with client(srv) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30,
                                                response_format=fmt, logit_bias={str(think[0]): -100})
    msg = reply.choices[0].message
    assert extra(msg, "reasoning_content") is None and json.loads(msg.content)["answer"] in ("yes", "no")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


async def test_deepseek_r1_starts_inside_the_thinking(model_path, tmp_path_factory):
    """deepseek_r1: the reply is thinking until `</think>` whether or not it opens with `<think>` (dropped);
    its constraint waits for `</think>` alone."""
    server = Server(model_path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64",
                    "--reasoning-parser", "deepseek_r1").wait_ready()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
        async with client(server) as c:  # greedy, so the three can share a batch
            plain, held, cut = await asyncio.gather(*(
                c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **extra_args)
                for extra_args in ({"max_tokens": 20}, {"max_tokens": 30, "response_format": fmt},
                                   {"max_tokens": 30, "stop": ["world"]})))
    finally:
        server.stop()
    assert (extra(plain.choices[0].message, "reasoning_content"), plain.choices[0].message.content) == (
        REASONING, ANSWER)
    assert extra(held.choices[0].message, "reasoning_content") == REASONING
    assert json.loads(held.choices[0].message.content)["answer"] in ("yes", "no")
    # a stop string inside the thinking ends the reply there: all of it is thinking
    assert (extra(cut.choices[0].message, "reasoning_content"), cut.choices[0].message.content) == ("Hello ", "")
