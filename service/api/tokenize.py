"""vLLM's /tokenize and /detokenize: what the server's tokenizer and chat template make of a text.

The work runs in the preparation pool (service/api/preprocess.py): a megabyte of text through the tokenizer
would otherwise pause every stream.
"""

from __future__ import annotations

from aiohttp import web

from sluice.service.api import json_codec
from sluice.service.api.errors import ApiErrorCode, RequestError
from sluice.service.api.middlewares import STATE
from sluice.service.api.preprocess import chat_prompt_ids, check_model, load_body
from sluice.service.api.protocol import parse_chat
from sluice.service.engine.async_engine import ModelInfo

MAX_TOKENS = 1 << 20


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt"} or {"messages", "add_generation_prompt"} -> {"count", "max_model_len", "tokens"[, "token_strs"]}."""
    state, raw = await _state_and_body(request)
    return _json(await state.preprocessor.run(_tokenize, raw, state.engine.model))


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    state, raw = await _state_and_body(request)
    return _json(await state.preprocessor.run(_detokenize, raw, state.engine.model))


def _tokenize(raw: bytes, model: ModelInfo) -> dict:
    body = _checked(raw, model)
    tokenizer = model.tokenizer
    if body.get("messages") is not None:
        chat = parse_chat({"messages": body["messages"], "chat_template_kwargs": body.get("chat_template_kwargs")})
        ids = chat_prompt_ids(tokenizer, chat.messages, None, _flag(body, "add_generation_prompt", True),
                              _flag(body, "add_special_tokens", False), chat.template_kwargs)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("give 'prompt' (a string) or 'messages'", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    out = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": list(ids)}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
    return out


def _detokenize(raw: bytes, model: ModelInfo) -> dict:
    body = _checked(raw, model)
    tokens = body.get("tokens")
    vocab = model.vocab_size
    if (not isinstance(tokens, list) or len(tokens) > MAX_TOKENS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
        raise RequestError(f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return {"prompt": model.tokenizer.decode(tokens)}


async def _state_and_body(request: web.Request):
    state = request.app[STATE]
    raw = await request.read()
    if state.engine is None:
        raise RequestError("the model is still loading", code=ApiErrorCode.LOADING)
    return state, raw


def _checked(raw: bytes, model: ModelInfo) -> dict:
    body = load_body(raw)
    check_model(body.get("model"), model)
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return v


def _json(payload) -> web.Response:
    return web.Response(body=json_codec.dumps(payload), content_type="application/json")
