"""Anthropic's Messages API: `POST /v1/messages` (streamed and not), `POST /v1/messages/count_tokens`, and the
`HEAD /` Claude Code probes. A body becomes the chat path's request (anthropic_request.py), is admitted as the
chat route admits its own, and its outputs are rendered in Anthropic's shapes (anthropic_reply.py); errors are
the shared path's RequestErrors in Anthropic's shape (anthropic_errors.py, chosen by path in middlewares.py).

The serving steps themselves are api_server's (which imports this module, so they are handed in by create_app):
the engine lookup (503 while loading or draining), admission (the engine's refusals as the client's errors), the
SSE writer (write timeouts, the bounded send buffer, a client that leaves) and the error of a failed output.

Streaming: like the chat route's, the headers wait for the first output, so a request that fails before it gets
a real HTTP status. A long prefill must not look like a dead connection, though: when no output has come for
PING_INTERVAL seconds, the headers go out with `message_start` and a `ping` event, and another ping follows each
further quiet interval. A failure after that is Anthropic's `error` event, which ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from sluice.service.api import json_codec
from sluice.service.api.anthropic_errors import error_body
from sluice.service.api.anthropic_reply import MessageBuilder
from sluice.service.api.anthropic_request import count_tokens, prepare_messages, renamed
from sluice.service.api.errors import RequestError
from sluice.service.api.middlewares import STATE
from sluice.service.api.protocol import RequestCaps

logger = logging.getLogger("sluice.api")
PING_INTERVAL = 5.0  # seconds without output before a `ping` keeps a stream alive (Anthropic pings as often)


class _Ping:
    """What Pinged yields for a quiet interval (`error` None: the SSE writer's first look takes it as an output)."""

    error = None


PING = _Ping()


class Pinged:
    """An engine stream's outputs, with PING whenever `interval` seconds pass without one. The pending read is never
    cancelled by a timeout (an output that arrives just then is not lost); `close()` cancels it when the reply is
    over."""

    __slots__ = ("stream", "interval", "_next")

    def __init__(self, stream, interval: float = PING_INTERVAL):
        self.stream, self.interval = stream, interval
        self._next: asyncio.Future | None = None

    def __aiter__(self) -> Pinged:
        return self

    async def __anext__(self):
        if self._next is None:
            self._next = asyncio.ensure_future(_read(self.stream))
        done, _ = await asyncio.wait({self._next}, timeout=self.interval)
        if not done:
            return PING
        out, self._next = self._next.result(), None
        if out is _END:
            raise StopAsyncIteration
        return out

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None


_END = object()


async def _read(stream):
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END


def sse(events: list[dict]) -> bytes:
    """Named Server-Sent Events: `event: <type>` and its `data:`."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json_codec.dumps(e) + b"\n\n" for e in events)


def _json(payload: dict) -> web.Response:
    return web.Response(body=json_codec.dumps(payload), content_type="application/json")


class MessagesAPI:
    """The Messages routes over the serving steps api_server hands in (see the module's doc)."""

    def __init__(self, engine: Callable, admit: Callable, stream: Callable, error_of: Callable):
        self.engine, self.admit, self.stream, self.error_of = engine, admit, stream, error_of

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens),
                web.head("/", self.root)]

    async def root(self, request: web.Request) -> web.Response:
        """The server answers (Claude Code's reachability probe; open like the health probes)."""
        return web.Response()

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic count_tokens: the prompt's tokens as /v1/messages counts them."""
        state = request.app[STATE]
        raw = await request.read()
        aengine = self.engine(state)
        server = state.config.server
        n = await state.preprocessor.run(count_tokens, raw, aengine.model, server.tool_call_parser,
                                         server.reasoning_parser, RequestCaps.of(server))
        return _json({"input_tokens": n})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages API (Claude Code, the `anthropic` SDK), streamed or not."""
        state = request.app[STATE]
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
        aengine = self.engine(state)
        model = aengine.model
        server = state.config.server
        prep = await state.preprocessor.run(prepare_messages, raw, model, server.tool_call_parser,
                                            server.reasoning_parser, RequestCaps.of(server))
        prompt = len(prep.batch[0][1])
        logger.info("%s: messages, prompt tokens %d, max_tokens %d, stream=%s", prep.prefix, prompt,
                    prep.batch[0][2].max_tokens, prep.req.stream)
        try:
            stream = await self.admit(request, aengine, prep.batch, prep.req.priority, "messages")
        except RequestError as e:
            raise renamed(e) from None
        [choice] = prep.choices.values()
        builder = MessageBuilder(prep.prefix, prep.req.model or model.served_model_name, choice, prompt)
        async with stream:
            if prep.req.stream:
                pinged = Pinged(stream)
                try:
                    return await self.stream(request, pinged, lambda outputs: self._events(outputs, builder),
                                             lambda err: sse([error_body(err)]))
                finally:
                    pinged.close()
            async for out in stream:
                if out.error:
                    raise self.error_of(out)
                builder.feed(out)
            builder.finish()
            return _json(builder.message())

    async def _events(self, outputs, builder: MessageBuilder):
        """A streamed message's events: message_start, pings while quiet, the blocks, message_delta, message_stop."""
        started = False
        async for out in outputs:
            if out is PING:
                yield sse([*(() if started else builder.start()), {"type": "ping"}])
                started = True
                continue
            if out.error:  # headers are out: Anthropic's error event ends the stream
                yield sse([error_body(self.error_of(out))])
                return
            events = builder.feed(out)
            if not started:
                events = builder.start() + events  # the first output has said the prompt's cached share
                started = True
            if events:
                yield sse(events)
        yield sse([*(() if started else builder.start()), *builder.finish()])
