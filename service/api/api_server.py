"""The OpenAI-compatible HTTP API: thin aiohttp handlers; request ids, auth and error shape are middlewares."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from aiohttp import web

from sluice.metrics.prometheus import render_latest
from sluice.metrics.tracing import server_timing
from sluice.scheduling.outcomes import ErrorCode, RequestRejected
from sluice.service.api import json_codec
from sluice.service.api.anthropic import MessagesAPI
from sluice.service.api.embeddings import embedding_response, prepare_embeddings
from sluice.service.api.errors import ApiErrorCode, RequestError, code_named
from sluice.service.api.formatting import Choice, ResponseFormat, record, usage
from sluice.service.api.lora_routes import adapter_cards, load_lora_adapter, unload_lora_adapter
from sluice.service.api.middlewares import (
    REQUEST_ID,
    STATE,
    ServerState,
    _add_request_id_header,
    auth_middleware,
    error_middleware,
    request_id_middleware,
    request_id_var,
)
from sluice.service.api.openapi import openapi_spec
from sluice.service.api.preprocess import prepare_generate
from sluice.service.api.protocol import RequestCaps
from sluice.service.api.reasoning import split_output
from sluice.service.api.rerank import prepare_rerank, prepare_score
from sluice.service.api.responses import ResponseBuilder, head
from sluice.service.api.responses_request import prepare_responses, renamed
from sluice.service.api.tokenize import detokenize, tokenize
from sluice.service.api.tool_parsers import finish_collected, stream_deltas
from sluice.service.config import SluiceConfig
from sluice.service.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
)
from sluice.service.structured.grammar import GrammarError

logger = logging.getLogger("sluice.api")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sluice")
    except Exception:  # running from a source tree that was never installed
        return "0+unknown"


# ---- probes and metadata --------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while loading or serving, 503 once the engine loop has died; with engine counters."""
    state = request.app[STATE]
    engine = state.engine
    if engine is None:
        return _json({"status": "loading"})
    if not engine.is_alive:
        raise RequestError("the engine is dead", code=ErrorCode.ENGINE_DEAD)
    s = engine.stats
    return _json({
        "status": "draining" if state.draining else "ok",
        "kv_free_blocks": s.get("free_blocks"), "kv_total_blocks": s.get("total_blocks"),
        "kv_free_host_blocks": s.get("free_host_blocks"), "kv_total_host_blocks": s.get("total_host_blocks"),
        "running": s.get("running"), "waiting": s.get("waiting"), "swapped": s.get("swapped"),
        "open_streams": engine.num_open_streams, "preemptions": s.get("preemptions"),
    })


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 only with the model loaded, the engine running and the server not draining."""
    state = request.app[STATE]
    if state.engine is None or state.draining or not state.engine.is_alive:
        why = ApiErrorCode.LOADING if state.engine is None else ApiErrorCode.DRAINING if state.draining \
            else ApiErrorCode.DEAD
        raise RequestError(f"not ready: {why}", code=why)
    return _json({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition of the default registry."""
    body, content_type = render_latest()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def version(request: web.Request) -> web.Response:
    """The Sluice version."""
    return _json({"version": _version()})


async def openapi(request: web.Request) -> web.Response:
    """OpenAPI 3 description of the completion and embedding endpoints."""
    return _json(openapi_spec(_version()))


async def models(request: web.Request) -> web.Response:
    """The served model and its LoRA adapters, by name and never by path (`parent`: the base model)."""
    model = _engine(request.app[STATE]).model
    state = request.app[STATE]
    return _json({"object": "list", "data": [{
        "id": model.served_model_name, "object": "model", "created": state.started,
        "owned_by": "sluice", "max_model_len": model.max_model_len, "root": model.served_model_name, "parent": None,
    }, *adapter_cards(model, state.started)]})


def _json(payload, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json_codec.dumps(payload), content_type="application/json")


def _engine(state: ServerState) -> AsyncEngine:
    if state.draining:
        raise RequestError("the server is shutting down", code=ApiErrorCode.DRAINING)
    if state.engine is None:
        raise RequestError("the model is still loading", code=ApiErrorCode.LOADING)
    return state.engine


# ---- completions ----------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    aengine = _engine(state)
    model = aengine.model
    # Parsing, the chat template and the tokenizer run in the preparation pool, never on the event loop.
    server = state.config.server
    prep = await state.preprocessor.run(prepare_generate, raw, chat, model, server.tool_call_parser,
                                        server.reasoning_parser, RequestCaps.of(server))
    req, prefix, batch = prep.req, prep.prefix, prep.batch
    prompt_lens = [len(ids) for _, ids, _ in batch[::req.n]]  # the n samples of a prompt are adjacent
    logger.info("%s: %s, %d prompt(s) x n=%d, prompt tokens %s, max_tokens %d, stream=%s", prefix,
                "chat" if req.chat else "completion", len(prompt_lens), req.n, prompt_lens,
                batch[0][2].max_tokens, req.stream)
    stream = await _admit(request, aengine, batch, req.priority, "messages" if req.chat else "prompt")
    fmt = ResponseFormat(req, prefix, req.model or model.served_model_name, model.tokenizer)  # or the adapter
    async with stream:
        if req.stream:
            return await _stream(request, stream, lambda outputs: _chat_events(outputs, prep.choices, fmt),
                                 lambda err: _sse(err.to_dict()) + _DONE)
        return await _collect(stream, prep.choices, fmt)


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings: one pooled vector per input, from prompt-only requests in the same batches."""
    state = request.app[STATE]
    raw = await request.read()
    aengine = _engine(state)
    prep = await state.preprocessor.run(prepare_embeddings, raw, aengine.model, RequestCaps.of(state.config.server))
    stream = await _admit(request, aengine, prep.batch, prep.priority, "input")
    outputs = await _pooled_outputs(stream)
    return web.Response(body=embedding_response(prep, outputs, aengine.model.served_model_name),
                        content_type="application/json")


async def rerank(request: web.Request) -> web.Response:
    """Rerank (Jina/Cohere shape): the documents scored against the query by a decoder reranker, best first."""
    return await _scores(request, prepare_rerank, "documents")


async def score(request: web.Request) -> web.Response:
    """Score: text_1 against text_2 (1:1, 1:N or N:N) by a decoder reranker."""
    return await _scores(request, prepare_score, "text_2")


async def _scores(request: web.Request, prepare, param: str) -> web.Response:
    """A rerank or score call: one prompt-only request per pair, admitted together (one flow), scores collected."""
    state = request.app[STATE]
    raw = await request.read()
    aengine = _engine(state)
    prep = await state.preprocessor.run(prepare, raw, aengine.model, RequestCaps.of(state.config.server))
    stream = await _admit(request, aengine, prep.batch, prep.priority, param)
    outputs = await _pooled_outputs(stream)
    return web.Response(body=prep.response(outputs, aengine.model.served_model_name), content_type="application/json")


async def _pooled_outputs(stream) -> dict:
    """A prompt-only call's outputs by engine request id; the first error ends it as an HTTP error."""
    outputs = {}
    async with stream:
        async for out in stream:
            if out.error:
                raise _error_of(out)
            outputs[out.request_id] = out
    return outputs


async def _admit(request: web.Request, aengine: AsyncEngine, batch: list, priority: int, param: str):
    """Queue an API call's engine requests; the engine's refusals as the client's errors (`param`: the prompt's)."""
    try:
        return await aengine.add_requests(batch, priority, _trace_headers(request, aengine), _tenant(request))
    except GrammarError as e:  # a schema, regex, choice or grammar that does not compile
        raise RequestError(str(e), e.param, code_named(e.code)) from None
    except RequestRejected as e:  # the scheduler's word: a prompt that can never run, an id in use
        raise RequestError(str(e), param, e.code) from None
    except ValueError as e:  # the engine's word on a prompt or its parameters
        raise RequestError(str(e), param) from None
    except QueueFullError as e:
        raise RequestError(f"{e}; retry shortly", code=ApiErrorCode.RATE_LIMIT_EXCEEDED,
                           headers={"Retry-After": "1"}) from None
    except EngineDrainingError:  # another replica can take it
        raise RequestError("the server is shutting down", code=ApiErrorCode.DRAINING,
                           headers={"x-should-retry": "true"}) from None
    except EngineDeadError:
        raise RequestError("the engine is not available", code=ErrorCode.ENGINE_DEAD,
                           headers={"x-should-retry": "true"}) from None


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: stateless, the chat path's request in the Responses API's shapes."""
    state = request.app[STATE]
    raw = await request.read()
    aengine = _engine(state)
    model = aengine.model
    server = state.config.server
    prep, body = await state.preprocessor.run(prepare_responses, raw, model, server.tool_call_parser,
                                              server.reasoning_parser)
    logger.info("%s: response, prompt tokens %d, max_tokens %d, stream=%s", prep.prefix, len(prep.batch[0][1]),
                prep.batch[0][2].max_tokens, prep.req.stream)
    try:
        stream = await _admit(request, aengine, prep.batch, prep.req.priority, "messages")
    except RequestError as e:
        raise renamed(e) from None
    [choice] = prep.choices.values()
    builder = ResponseBuilder(head(body, prep.prefix, prep.req.model or model.served_model_name), choice)
    async with stream:
        if prep.req.stream:
            return await _stream(request, stream, lambda outputs: _response_events(outputs, builder),
                                 lambda err: _events(builder.error(err)))
        async for out in stream:
            if out.error:
                raise _error_of(out)
            builder.feed(out)
        builder.finish()
        return _json(builder.response())


async def _response_events(outputs, builder: ResponseBuilder):
    """A streamed response's events, each as `event: <type>` and its `data:`."""
    yield _events(builder.start())
    async for out in outputs:
        if out.error:  # headers are out: the spec's error event ends the stream
            yield _events(builder.error(_error_of(out)))
            return
        events = builder.feed(out)
        if events:
            yield _events(events)
    yield _events(builder.finish())


def _events(events: list[dict]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json_codec.dumps(e) + b"\n\n" for e in events)


def _tenant(request: web.Request) -> str | None:
    """The tenant the operator's trusted header names (--tenant-header; None: off or absent), cut to 128 chars."""
    header = request.app[STATE].config.scheduler.tenant_header
    return (request.headers.get(header) or "")[:128] or None if header else None


def _trace_headers(request: web.Request, aengine: AsyncEngine) -> dict[str, str] | None:
    """The client's W3C trace context when tracing is on (an empty dict: traced, as a root span)."""
    if aengine.tracer is None:
        return None
    return {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k)) is not None}


def _error_of(out) -> RequestError:
    """The client-facing error for a request that ended badly (details are in the server log)."""
    code = out.error_code or ErrorCode.INTERNAL_ERROR  # status, type and retry hint: see ErrorCode
    if code.public:
        message = out.error or "the request was aborted"
    else:  # internals stay in the log
        logger.error("generation failed: %s", out.error)
        message = f"generation failed (request id {request_id_var.get()})"
    return RequestError(message, code=code, headers={"x-should-retry": "true" if code.retry else "false"})


async def _collect(stream, choices: dict[str, Choice], fmt: ResponseFormat) -> web.Response:
    timelines = []
    async for out in stream:
        choice = choices[out.request_id]
        if out.error:
            raise _error_of(out)
        if out.timeline is not None:
            timelines.append(out.timeline)
        choice.logprobs.extend(out.logprobs)
        record(choice, out)
        reasoning, out = split_output(choice, out)  # reasoning models: the thinking apart, the answer in text
        if reasoning:
            choice.reasoning_text.append(reasoning)
        choice.text.append(out.text)
    for choice in choices.values():
        finish_collected(choice)  # tools: content and tool calls
    ordered = sorted(choices.values(), key=lambda c: c.index)
    resp = _json(fmt.response(ordered, usage(choices)))
    if timelines:  # where the time went, for a client without a tracing stack (the slowest choice's phases)
        resp.headers["Server-Timing"] = server_timing(timelines)
    return resp


async def _stream(request: web.Request, stream, events, failure) -> web.StreamResponse:
    """Stream `events(outputs)` (each event's SSE bytes); once the headers are out, an internal error can only be
    the event `failure(error)` returns."""
    # Headers wait for the first output: a request that ends before producing anything (queue timeout, failed
    # step, shutdown) then gets a real HTTP status the client's retry logic can read, not a 200 and an event.
    first = await anext(stream, None)
    if first is not None and first.error:
        raise _error_of(first)
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    _bound_send_buffer(request, request.app[STATE].config.server.stream_send_buffer)
    timeout = request.app[STATE].config.server.stream_write_timeout

    async def _outputs():
        if first is not None:
            yield first
        async for out in stream:
            yield out

    try:
        async for data in events(_outputs()):
            await _write(request, resp, data, timeout)
        await resp.write_eof()
    except ConnectionError:  # the client left: `async with stream` aborts the rest
        logger.info("client disconnected mid-stream")
    except Exception:  # headers are out: the error can only be an event
        logger.exception("stream failed")
        err = RequestError(f"internal server error (request id {request[REQUEST_ID]})", code=ErrorCode.INTERNAL_ERROR)
        try:
            await _write(request, resp, failure(err), timeout)
        except ConnectionError:
            pass
    return resp


_DONE = b"data: [DONE]\n\n"


def _sse(payload: dict) -> bytes:
    return b"data: " + json_codec.dumps(payload) + b"\n\n"


async def _chat_events(outputs, choices: dict[str, Choice], fmt: ResponseFormat):
    """A completions or chat stream's events: chunks, then the usage chunk when asked, then [DONE]."""
    for choice in sorted(choices.values(), key=lambda c: c.index):
        if fmt.req.chat:  # OpenAI opens each chat choice with the role
            yield _sse(fmt.chunk(choice, "", None, role=True))
        elif choice.echo:
            yield _sse(fmt.chunk(choice, choice.echo, None))
            choice.text_offset += len(choice.echo)
    async for out in outputs:
        choice = choices[out.request_id]
        if out.error:
            yield _sse(_error_of(out).to_dict())
            break
        record(choice, out)
        reasoning, out = split_output(choice, out)  # reasoning models: the thinking first, in a chunk of its own
        if reasoning:
            yield _sse(fmt.chunk(choice, "", None, logprobs=out.logprobs, reasoning=reasoning))
            out = dataclasses.replace(out, logprobs=[])
        for text, calls, finish, logprobs in stream_deltas(choice.tools, out):  # tools: calls held, parsed
            yield _sse(fmt.chunk(choice, text, finish, logprobs=logprobs, tool_calls=calls))
            choice.text_offset += len(text)
    else:
        if fmt.req.include_usage:
            yield _sse(fmt.usage_chunk(usage(choices)))
    yield _DONE


def _bound_send_buffer(request: web.Request, size: int) -> None:
    """Cap the kernel's send buffer for this stream: loopback autotuning lets it reach megabytes, so a client
    that stops reading would otherwise stall its write (and so the abort) only after minutes of output."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None and size > 0 else None
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except (OSError, AttributeError):  # not a TCP socket (a test transport): nothing to bound
            pass


async def _write(request: web.Request, resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    """Write one SSE event; a client that leaves it unread past `timeout` s is cut off (ConnectionError)."""
    try:
        await asyncio.wait_for(resp.write(data), timeout)
    except asyncio.TimeoutError:
        # Its socket buffers are full and it reads nothing: drop the connection so this handler (and the
        # engine requests behind it, aborted on the way out) do not wait on it forever.
        logger.warning("client stopped reading its stream for %.1fs; dropping the connection", timeout)
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("client stopped reading") from None


# ---- the app --------------------------------------------------------------------------------------

def create_app(config: SluiceConfig) -> web.Application:
    """The aiohttp application; set `app[STATE].engine` once the model is loaded."""
    middlewares = [request_id_middleware, error_middleware]
    if config.server.api_key:
        middlewares.append(auth_middleware(config.server.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_request_body_bytes)
    app[STATE] = ServerState(config)
    app.on_response_prepare.append(_add_request_id_header)
    app.add_routes([
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/embeddings", embeddings),
        *(web.post(path, rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
        *(web.post(path, score) for path in ("/v1/score", "/score")),
        web.post("/v1/responses", responses),
        web.get("/v1/models", models),
        web.post("/v1/load_lora_adapter", load_lora_adapter),
        web.post("/v1/unload_lora_adapter", unload_lora_adapter),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
        web.get("/version", version),
        web.get("/openapi.json", openapi),
    ])
    app.add_routes(MessagesAPI(_engine, _admit, _stream, _error_of).routes())  # Anthropic's /v1/messages
    return app
