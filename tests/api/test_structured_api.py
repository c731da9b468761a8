"""Structured outputs over HTTP with the official `openai` client: response_format json_schema / json_object,
vLLM's structured_outputs and guided_* extras, streamed and not, and 400s that name the bad parameter."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.support.http import stream_chat
from tests.support.server import MODEL, wait_idle
from tests.support.structured import SCHEMA

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return tiny_server


def client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "structured_outputs.grammar"),
    ({"extra_body": {"guided_choice": "yes"}}, "guided_choice"),
])
async def test_a_bad_constraint_is_a_400_naming_the_parameter(tiny, extra, param):
    async with client(tiny) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **extra)
    assert info.value.body["param"] == param, info.value.body
    await wait_idle(tiny)


async def test_guided_choice_and_regex_on_both_endpoints(tiny):
    async with client(tiny) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Pick one"}], temperature=0, max_tokens=20,
            extra_body={"guided_choice": ["red", "green", "blue"]})
        assert chat.choices[0].message.content in ("red", "green", "blue")
        assert chat.choices[0].finish_reason == "stop"
        done = await c.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=0.8, n=3,
                                          extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert len(done.choices) == 3
        for choice in done.choices:
            assert re.fullmatch("[A-Z]{2}-[0-9]{3}", choice.text), choice.text


# --- the real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smol_server):
    return smol_server


PERSON = [{"role": "system", "content": "You answer in JSON."},
          {"role": "user", "content": "Describe a fictional person: name, age, role, a few tags and an address."}]


@pytest.mark.slow
async def test_smollm2_json_schema_replies_validate(smol):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def reply(c, temperature: float, stream: bool) -> tuple[str, str | None]:
        kwargs = dict(model=MODEL, messages=PERSON, max_tokens=200, temperature=temperature, seed=1,
                      response_format=fmt)
        if not stream:
            whole = await c.chat.completions.create(**kwargs)
            return whole.choices[0].message.content, whole.choices[0].finish_reason
        out = await stream_chat(c, **kwargs)
        return out.content, out.finish

    async with client(smol) as c:  # greedy and sampled, streamed and not, side by side: one batch
        for text, finish in await asyncio.gather(
                *(reply(c, t, stream) for t in (0.0, 0.7) for stream in (False, True))):
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow
async def test_smollm2_json_object_and_choice(smol):
    async with client(smol) as c:
        reply = await c.chat.completions.create(model=MODEL, messages=PERSON, max_tokens=200, temperature=0,
                                                response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
        reply = await c.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=10,
            messages=[{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}],
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert reply.choices[0].message.content in ("yes", "no")
    await wait_idle(smol)
