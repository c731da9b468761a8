"""What every HTTP request passes through before its handler: request ids, errors in the shape of the path's
protocol (OpenAI's; Anthropic's on /v1/messages), the API key; and the app state (`STATE`) the middlewares and
the handlers of api_server.py share."""

from __future__ import annotations

import contextvars
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from sluice.metrics.prometheus import record_rejection
from sluice.scheduling.outcomes import ErrorCode
from sluice.service.api import json_codec
from sluice.service.api.anthropic_errors import error_body, speaks_anthropic
from sluice.service.api.errors import ApiErrorCode, RequestError
from sluice.service.api.preprocess import Preprocessor
from sluice.service.config import SluiceConfig
from sluice.service.engine.async_engine import AsyncEngine

logger = logging.getLogger("sluice.api")


request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # reachable without the API key (probes, scrapers)
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(slots=True)
class ServerState:
    """What the handlers share: the config, and the engine once it is loaded."""

    config: SluiceConfig
    engine: AsyncEngine | None = None  # None while the model loads
    draining: bool = False
    started: int = field(default_factory=lambda: int(time.time()))
    preprocessor: Preprocessor = field(default_factory=Preprocessor)  # parsing and tokenizing, off the loop


STATE = web.AppKey("state", ServerState)
REQUEST_ID = web.RequestKey("request_id", str)


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Echo a sane X-Request-Id or make one; it tags the logs of this request and its response."""
    rid = request.headers.get("X-Request-Id", "")
    if not _SAFE_REQUEST_ID.fullmatch(rid):
        rid = uuid.uuid4().hex
    request[REQUEST_ID] = rid
    request_id_var.set(rid)  # the handler task's own context: no reset needed
    return await handler(request)


async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request.get(REQUEST_ID) or uuid.uuid4().hex


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as OpenAI's {"error": {...}} (Anthropic's shape on its paths); internals stay in the log."""
    try:
        return await handler(request)
    except RequestError as e:
        _count_rejection(request, e)
        level = logging.DEBUG if request.path in OPEN_PATHS else logging.INFO  # probes 503 while loading
        logger.log(level, "%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        return error_response(e, request.path)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = _from_http_exception(request, e)
        _count_rejection(request, err)
        return error_response(err, request.path)
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(RequestError(f"internal server error (request id {request[REQUEST_ID]})",
                                           code=ErrorCode.INTERNAL_ERROR), request.path)


def _count_rejection(request: web.Request, e: RequestError) -> None:
    """Count a refused API call in sluice_requests_rejected_total (probes and unknown paths are not API calls)."""
    engine = request.app[STATE].engine
    if engine is not None and request.path.startswith("/v1/"):
        record_rejection(engine.model.served_model_name, e.status, e.code)


def _from_http_exception(request: web.Request, e: web.HTTPException) -> RequestError:
    """aiohttp's refusals in the handler chain (routing and reading the body: 404, 405, 413) as the API's."""
    if e.status == 404:
        return RequestError(f"no such endpoint: {request.method} {request.path}", code=ApiErrorCode.NOT_FOUND)
    if e.status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        return RequestError(f"method {request.method} not allowed on {request.path}",
                            code=ApiErrorCode.METHOD_NOT_ALLOWED, headers={"Allow": allowed})
    if e.status == 413:
        limit = request.app[STATE].config.server.max_request_body_bytes
        return RequestError(f"request body too large (limit {limit} bytes)", code=ApiErrorCode.REQUEST_TOO_LARGE)
    return RequestError(e.reason or "bad request")  # none other reaches here (417 is answered before the chain)


def error_response(e: RequestError, path: str = "") -> web.Response:
    """The error body with the error's status (and its headers: Retry-After, Allow, ...): OpenAI's, or Anthropic's
    on its paths."""
    body = error_body(e) if speaks_anthropic(path) else e.to_dict()
    return web.Response(status=e.status, body=json_codec.dumps(body), content_type="application/json",
                        headers=e.headers)


def auth_middleware(api_key: str):
    """When an API key is set, everything but the probes (and `HEAD /`, which says only that a server answers)
    needs `Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>`, each compared in constant time."""
    expected = {"Authorization": f"Bearer {api_key}".encode(), "x-api-key": api_key.encode()}

    def _given(request: web.Request, header: str) -> bool:
        value = request.headers.get(header)
        return value is not None and hmac.compare_digest(value.encode("utf-8", "replace"), expected[header])

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path not in OPEN_PATHS and not (request.method == "HEAD" and request.path == "/"):
            if not (_given(request, "Authorization") or _given(request, "x-api-key")):
                raise RequestError("invalid or missing API key (expected 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>')", code=ApiErrorCode.INVALID_API_KEY,
                                   headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware
