"""vLLM's /tokenize and /detokenize: what the server's tokenizer and chat template make of a text."""

from __future__ import annotations

import orjson
from aiohttp import web

from sluice.service.api.errors import RequestError
from sluice.service.api.middlewares import STATE
from sluice.service.api.protocol import parse_chat

MAX_TOKENS = 1 << 20


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt"} or {"messages", "add_generation_prompt"} -> {"count", "max_model_len", "tokens"[, "token_strs"]}."""
    body, engine = await _body_and_engine(request)
    tokenizer = engine.tokenizer
    if body.get("messages") is not None:
        messages = parse_chat({"messages": body["messages"]}).messages
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=_flag(body, "add_generation_prompt", True))
        except Exception as e:
            raise RequestError(f"the chat template rejected the messages: {e}", "messages") from None
        tokens = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("give 'prompt' (a string) or 'messages'", "prompt")
        tokens = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    out = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": list(tokens)}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(list(tokens))
    return _json(out)


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    body, engine = await _body_and_engine(request)
    tokens = body.get("tokens")
    vocab = getattr(engine, "vocab_size", None) or len(engine.tokenizer)
    if (not isinstance(tokens, list) or len(tokens) > MAX_TOKENS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
        raise RequestError(f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return _json({"prompt": engine.tokenizer.decode(tokens)})


async def _body_and_engine(request: web.Request):
    state = request.app[STATE]
    if state.engine is None:
        raise RequestError("the model is still loading", status=503, type="server_error", code="loading")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    engine = state.engine.engine
    model = body.get("model")
    if model is not None and model != engine.served_model_name:
        raise RequestError(f"the model '{model}' does not exist", "model", status=404, code="model_not_found")
    return body, engine


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return v


def _json(payload) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
