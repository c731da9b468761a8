"""HTTP client helpers for the tests that speak to `sluice serve`: requests, strict SSE parsing, error shape."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import aiohttp

from tests.support.replies import check_event, check_reply
from tests.support.server import MODEL

TIMEOUT = aiohttp.ClientTimeout(total=60)


async def post(url: str, path: str, body, headers=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url + path, data=data, headers=headers) as r:
        reply = await r.json(content_type=None)
        check_reply(path, r.status, reply)
        return r.status, reply, r.headers.copy()


async def get(url: str, path: str, headers=None) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url + path, headers=headers) as r:
        return r.status, await r.read(), r.headers.copy()


def parse_sse(raw: bytes) -> list[dict]:
    """Strict: only `data: <json>` events separated by blank lines, ending with `data: [DONE]`."""
    text = raw.decode("utf-8")  # a broken multi-byte character would fail here
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    out = []
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev, repr(ev)
        out.append(json.loads(ev[len("data: "):]))
    return out


async def stream(url: str, path: str, body: dict, headers=None) -> list[dict]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url + path, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = parse_sse(await r.read())
    for event in events:
        check_event(path, event)
    return events


def check_chunks(chunks: list[dict], obj: str) -> None:
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    for c in chunks:
        assert c["object"] == obj and c["model"] == MODEL and isinstance(c["created"], int)


def joined(chunks: list[dict], index: int = 0) -> str:
    key = "text" if chunks[0]["object"] == "text_completion" else None
    parts = []
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index:
                parts.append(ch["text"] if key else ch["delta"].get("content", ""))
    return "".join(parts)


def finish_reasons(chunks: list[dict], index: int = 0) -> list[str]:
    return [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["index"] == index and ch["finish_reason"]]


def check_error(status: int, body: dict, want_status: int, param=None) -> None:
    assert status == want_status, body
    check_reply("/", status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def good_request(url: str, headers=None) -> None:
    status, body, _ = await post(url, "/v1/completions",
                                 {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, headers)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


@dataclass(slots=True)
class StreamedChat:
    """An openai-client chat stream of one choice, joined: its text, its thinking, its finish reason, its tool
    calls (deltas joined by index as the client does: id, name, arguments) and the chunks themselves."""

    content: str = ""
    reasoning: str = ""
    finish: str | None = None
    calls: dict[int, dict] = field(default_factory=dict)
    chunks: list = field(default_factory=list)


async def stream_chat(client, **kwargs) -> StreamedChat:
    """Send a chat request with stream=True through the openai client and join what comes back."""
    out = StreamedChat()
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        out.chunks.append(chunk)
        for choice in chunk.choices:
            delta = choice.delta
            out.content += delta.content or ""
            out.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for d in delta.tool_calls or []:
                entry = out.calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            out.finish = choice.finish_reason or out.finish
    return out
