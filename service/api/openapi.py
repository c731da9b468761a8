"""/openapi.json, generated from the protocol's pydantic models: the paths and statuses are the only hand-kept part."""

from __future__ import annotations

import copy
from functools import lru_cache

from pydantic.json_schema import models_json_schema

from sluice.service.api.protocol_embeddings import EmbeddingRequest, EmbeddingResponse
from sluice.service.api.protocol_models import ChatCompletionRequest, CompletionRequest
from sluice.service.api.protocol_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
)
from sluice.service.api.responses_models import Response, ResponsesRequest, StreamEvent

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Invalid parameters, or a prompt longer than the context or the KV cache can ever hold.",
    "401": "Missing or wrong 'Authorization: Bearer <key>' (when the server has an API key).",
    "404": "Unknown model.",
    "413": "Request body over --max-request-body-bytes.",
    "429": "More than --max-queued-requests are waiting; see Retry-After.",
    "503": "The server is loading or shutting down.",
    "500": "Internal error; the server log has the details under the X-Request-Id.",
}


def _ref(model) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _operation(summary: str, request, response, chunk=None, stream_doc: str = "") -> dict:
    if chunk is not None:
        stream_doc = stream_doc or f"Server-Sent Events whose data are {chunk.__name__} objects, ending in " \
            "'data: [DONE]'"
    responses = {"200": {
        "description": f"The completion; with stream: true, {stream_doc}.",
        "content": {"application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": {"type": "string"}}}}} if chunk is not None else {"200": {
        "description": "The reply.", "content": {"application/json": {"schema": _ref(response)}}}}
    for status, doc in _ERRORS.items():
        responses[status] = {"description": doc, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": _ref(request)}}}, "responses": responses,
        "parameters": [{"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "Echoed in the response and the server log (generated when absent)."}]}}


@lru_cache(maxsize=1)
def _schemas() -> dict:
    """Every model's JSON schema (requests as validated, responses as written), keyed by model name."""
    models = [(m, "validation") for m in (CompletionRequest, ChatCompletionRequest, EmbeddingRequest,
                                          ResponsesRequest)]
    models += [(m, "serialization") for m in (Completion, ChatCompletion, ChatCompletionChunk, ErrorResponse,
                                              EmbeddingResponse, Response, StreamEvent)]
    _, schema = models_json_schema(models, ref_template=_REF)
    return schema["$defs"]


def openapi_spec(version: str) -> dict:
    """The document served at /openapi.json."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "Sluice", "version": version,
                 "description": "OpenAI-compatible completions with SSE streaming, served by Sluice."},
        "components": {"schemas": copy.deepcopy(_schemas()),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/v1/completions": _operation("Text completion", CompletionRequest, Completion, Completion),
            "/v1/chat/completions": _operation("Chat completion", ChatCompletionRequest, ChatCompletion,
                                               ChatCompletionChunk),
            "/v1/embeddings": _operation("Embeddings", EmbeddingRequest, EmbeddingResponse),
            "/v1/responses": _operation(
                "Responses API (stateless)", ResponsesRequest, Response, StreamEvent,
                "Server-Sent Events `event: <type>` / `data: <StreamEvent>` with the spec's types and "
                "sequence_number, ending in response.completed or response.incomplete (no [DONE])"),
        },
    }
