"""The one place the tests check the API's replies against its protocol models (service/api/protocol_*.py, the
shapes /openapi.json publishes): tests/support/http.py passes every reply and streamed event it reads through here,
so a reply that drifts from its declared model fails whichever test read it."""

from __future__ import annotations

from pydantic import BaseModel

from sluice.service.api.anthropic_errors import speaks_anthropic
from sluice.service.api.protocol_embeddings import EmbeddingResponse
from sluice.service.api.protocol_rerank import RerankResponse, ScoreResponse
from sluice.service.api.protocol_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
)

# path -> (the reply's model, a streamed event's model)
REPLIES: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/completions": (Completion, Completion),
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/embeddings": (EmbeddingResponse, None),
    **{path: (RerankResponse, None) for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
    **{path: (ScoreResponse, None) for path in ("/v1/score", "/score")},
}


def check_reply(path: str, status: int, body) -> None:
    """A JSON reply: OpenAI's error shape for any 4xx/5xx (Anthropic's paths aside), else its path's model."""
    path = path.split("?", 1)[0]
    if speaks_anthropic(path):
        return
    if status >= 400:
        ErrorResponse.model_validate(body)
    elif status == 200 and path in REPLIES:
        REPLIES[path][0].model_validate(body)


def check_event(path: str, event: dict) -> None:
    """One streamed `data:` event: its path's chunk, or the error a failed stream ends with."""
    model = ErrorResponse if "error" in event else REPLIES[path.split("?", 1)[0]][1]
    model.model_validate(event)
