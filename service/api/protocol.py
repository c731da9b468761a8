"""OpenAI request validation: JSON bodies in, a GenerateRequest with SamplingParams out, or a RequestError."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import orjson

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api.errors import RequestError
from sluice.service.api.structured import parse_structured_output
from sluice.service.api.tools import ToolSpec, parse_history_calls, parse_tools

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n: each is an engine request
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids in one logit_bias
MAX_TOKEN_LIST = 65536  # allowed_token_ids
MAX_MESSAGES = 4096
MAX_CACHE_SALT = 256
MAX_TEMPLATE_KWARGS = 32  # keys of chat_template_kwargs
MAX_TEMPLATE_KWARGS_BYTES = 16384  # their values as JSON
# apply_chat_template's own parameters and what the server renders itself: a request never sets these
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
_KWARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
INT32 = 2**31
INT64 = 2**63
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(slots=True)
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    chat: bool
    model: str | None
    params: SamplingParams  # max_tokens is a placeholder until resolve_params() when max_tokens is None
    max_tokens: int | None  # None: chat's default, whatever room the context leaves
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict] = field(default_factory=list)  # chat, content flattened to text
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    user: str | None = None
    echo: bool = False  # completions: the reply starts with the prompt's text
    tools: ToolSpec | None = None  # chat: tools, tool_choice, parallel_tool_calls (service/api/tools.py)
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs, e.g. enable_thinking


# ---- typed getters: bool is not a number, NaN and infinities are not numbers either ----

def _int(body: dict, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{name}' must be an integer", name)
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _float(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"'{name}' must be a finite number", name)
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return v


def _str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise RequestError(f"'{name}' must be a string", name)
    return v


def _unsupported(body: dict) -> None:
    """Reject parameters Sluice accepts only at their neutral value, rather than silently ignoring them."""
    if body.get("suffix") is not None:
        raise RequestError("'suffix' is not supported", "suffix")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' may hold at most {MAX_STOP} strings", "stop")
    if any(not 0 < len(s) <= MAX_STOP_LEN for s in stops):
        raise RequestError(f"each stop string must have 1 to {MAX_STOP_LEN} characters", "stop")
    return list(dict.fromkeys(stops))


def _stop_token_ids(body: dict) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS or not all(_is_token_id(t) for t in v):
        raise RequestError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    return v


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id as a string": bias in [-100, 100]}."""
    v = body.get("logit_bias")
    if v is None or v == {}:
        return None
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if not _is_token_id(token) or not ok or not -100 <= bias <= 100:
            raise RequestError("'logit_bias' maps token ids to numbers between -100 and 100", "logit_bias")
        out[token] = float(bias)
    return out


def _token_list(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v or len(v) > MAX_TOKEN_LIST or not all(_is_token_id(t) for t in v):
        raise RequestError(f"'{name}' must be a non-empty list of at most {MAX_TOKEN_LIST} token ids", name)
    return list(dict.fromkeys(v))  # deduplicated: its length is then bounded by the vocabulary as well


def _strings(body: dict, name: str) -> list[str]:
    v = body.get(name)
    if v is None:
        return []
    if (not isinstance(v, list) or len(v) > MAX_STOP
            or not all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_LEN for w in v)):
        raise RequestError(f"'{name}' must be a list of at most {MAX_STOP} non-empty strings", name)
    return v


def _cache_salt(body: dict) -> str | None:
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_CACHE_SALT:
        raise RequestError(f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters", "cache_salt")
    return v


def _is_token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < INT32


def _common(body: dict, chat: bool) -> GenerateRequest:
    """The parameters both endpoints share."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _unsupported(body)
    n = _int(body, "n", 1, MAX_N, 1)
    best_of = _int(body, "best_of", 1, MAX_N, n)
    if best_of != n:
        raise RequestError("'best_of' different from 'n' is not supported", "best_of")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 1, INT32, None if chat else 16)
    top_k = _int(body, "top_k", -1, INT32, 0)
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=_float(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_float(body, "top_p", 0.0, 1.0, 1.0),
        top_k=max(top_k, 0),  # -1 (vLLM's "off") and 0 both disable top-k
        min_p=_float(body, "min_p", 0.0, 1.0, 0.0),
        seed=_int(body, "seed", -INT64, INT64 - 1),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0, INT32, 0),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        structured_output=parse_structured_output(body),
        presence_penalty=_float(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_float(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_float(body, "repetition_penalty", 0.0, 100.0, 1.0),
        logit_bias=_logit_bias(body),
        allowed_token_ids=_token_list(body, "allowed_token_ids"),
        bad_words=_strings(body, "bad_words"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        cache_salt=_cache_salt(body),
    )
    if params.repetition_penalty == 0.0:
        raise RequestError("'repetition_penalty' must be greater than 0", "repetition_penalty")
    if params.top_p == 0.0:
        raise RequestError("'top_p' must be greater than 0", "top_p")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = _bool(opts or {}, "include_usage")
    return GenerateRequest(
        chat=chat, model=_str(body, "model"), params=params, max_tokens=max_tokens, n=n, stream=stream,
        include_usage=include_usage, priority=_int(body, "priority", -INT32, INT32 - 1, 0), user=_str(body, "user"),
    )


def parse_completion(body: dict) -> GenerateRequest:
    """Validate a /v1/completions body."""
    req = _common(body, chat=False)
    req.params.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    req.echo = _bool(body, "echo")
    if req.echo and req.params.logprobs is not None:
        raise RequestError("'echo' with 'logprobs' (the prompt's logprobs) is not supported", "echo")
    if body.get("tools") is not None:
        raise RequestError("'tools' are supported on /v1/chat/completions only", "tools")
    req.prompts = _prompts(body.get("prompt"))
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise RequestError(f"prompts x n must be at most {MAX_CHOICES}", "n")
    return req


def _prompts(v) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(v, str):
        v = [v]
    elif isinstance(v, list) and v and all(_is_token_id(t) for t in v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise RequestError("'prompt' must be a non-empty string, list of strings, or list of token ids", "prompt")
    if len(v) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    for p in v:
        ok = (isinstance(p, str) and p) or (isinstance(p, list) and p and all(_is_token_id(t) for t in p))
        if not ok:
            raise RequestError("each prompt must be a non-empty string or a non-empty list of token ids", "prompt")
    return v


def parse_chat(body: dict) -> GenerateRequest:
    """Validate a /v1/chat/completions body."""
    req = _common(body, chat=True)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if _bool(body, "logprobs"):
        req.params.logprobs = top or 0
    elif top is not None:
        raise RequestError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    req.tools = parse_tools(body)
    if req.tools is not None and req.tools.active and req.params.structured_output is not None:
        raise RequestError("tools with tool_choice other than 'none' cannot be combined with "
                           f"'{req.params.structured_output.param.split('.')[0]}'", "tool_choice")
    req.messages = _messages(body.get("messages"))
    req.template_kwargs = _template_kwargs(body)
    return req


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: an object of a few named values the chat template may read."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    name = "chat_template_kwargs"
    if not isinstance(v, dict) or len(v) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"'{name}' must be an object of at most {MAX_TEMPLATE_KWARGS} keys", name)
    for key in v:
        if not _KWARG_NAME.match(key):
            raise RequestError(f"'{name}' keys must be identifiers of at most 64 characters, got {key[:64]!r}", name)
        if key in TEMPLATE_RESERVED:
            raise RequestError(f"'{name}' may not set '{key}': the server renders it", f"{name}.{key}")
    try:
        size = len(orjson.dumps(v))
    except orjson.JSONEncodeError:
        size = MAX_TEMPLATE_KWARGS_BYTES + 1
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise RequestError(f"'{name}' must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON", name)
    return v


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty list", "messages")
    if len(v) > MAX_MESSAGES:
        raise RequestError(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None and role != "assistant":
            raise RequestError(f"{where}.content is required", f"{where}.content")
        msg = {"role": "system" if role == "developer" else role, "content": _content(content, f"{where}.content")}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
                msg[key] = m[key]
        if role == "tool" and "tool_call_id" not in msg:
            raise RequestError(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id")
        if m.get("tool_calls") is not None and role == "assistant":
            msg["tool_calls"] = parse_history_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _content(v, where: str) -> str:
    """Content as text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if v is None or isinstance(v, str):
        return v or ""
    if not isinstance(v, list):
        raise RequestError(f"{where} must be a string or a list of content parts", where)
    parts = []
    for p in v:
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise RequestError(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported", where)
        parts.append(p["text"])
    return "".join(parts)


def resolve_params(req: GenerateRequest, prompt_ids: list[int], max_model_len: int, vocab_size: int) -> SamplingParams:
    """Check one tokenized prompt against the model and return its SamplingParams with max_tokens settled."""
    param = "messages" if req.chat else "prompt"
    if not prompt_ids:
        raise RequestError(f"the {param} is empty after tokenization", param)
    bad = next((t for t in prompt_ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param)
    for name, ids in (("stop_token_ids", req.params.stop_token_ids), ("logit_bias", req.params.logit_bias or ()),
                      ("allowed_token_ids", req.params.allowed_token_ids or ())):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} in '{name}' is outside the vocabulary (0..{vocab_size - 1})", name)
    n = len(prompt_ids)
    max_tokens = req.max_tokens if req.max_tokens is not None else max_model_len - n
    # The scheduler owns this rule (RequestRejected); checked here too because max_tokens is settled here anyway,
    # and an early refusal never queues n requests behind a step on the engine thread to roll them back.
    if n + max(max_tokens, 1) > max_model_len:
        where = "in the messages" if req.chat else "in your prompt"
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max(max_tokens, 1)} tokens ({n} {where}, {max(max_tokens, 1)} for the completion). "
            f"Please reduce the length of the {param} or completion.",
            param, code="context_length_exceeded",
        )
    params = dataclasses.replace(req.params, max_tokens=max_tokens, stop=list(req.params.stop),
                                 stop_token_ids=list(req.params.stop_token_ids))
    try:
        params.validate()
    except ValueError as e:  # messages start with the field's name, e.g. "min_tokens must not exceed ..."
        name = str(e).split(" ", 1)[0]
        raise RequestError(str(e), name if name in _FIELDS else None) from None
    return params
