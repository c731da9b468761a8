"""OpenAI request validation: JSON bodies in, a GenerateRequest with SamplingParams out, or a RequestError.

The bodies are declared once, as the pydantic models of protocol_models.py; this module turns a validated model
into what the rest of the API consumes, checks what spans several fields, and renders pydantic's first error as
OpenAI's error naming the parameter by its path (`messages[3].content`, `stop[2]`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from pydantic import ValidationError

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api.errors import RequestError, context_length_error, param_path
from sluice.service.api.protocol_models import (
    TAGS,
    ChatCompletionRequest,
    CompletionRequest,
    HistoryCall,
    SamplingRequest,
)
from sluice.service.api.structured import parse_structured_output
from sluice.service.api.tools import ToolSpec, parse_tools
from sluice.service.config import ServerConfig

MAX_TEMPLATE_KWARGS_BYTES = 16384  # chat_template_kwargs' values as JSON
# apply_chat_template's own parameters and what the server renders itself: a request never sets these
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
_KWARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


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


# ---- what one request may fan out to --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RequestCaps:
    """What one request may fan out to: the one place these rules are decided (ServerConfig's --max-n,
    --max-prompts-per-request, --max-embedding-inputs). Each sequence or input is an engine request, so no cap is
    above --max-queued-requests either: past it the request could never be queued. Each refusal is a 400 naming the
    parameter and the flag that bounds it, before anything is tokenized."""

    max_n: int
    max_prompts: int  # prompts x n
    max_embedding_inputs: int
    max_queued: int

    @classmethod
    def of(cls, server: ServerConfig) -> RequestCaps:
        return cls(server.max_n, server.max_prompts_per_request, server.max_embedding_inputs,
                   server.max_queued_requests)

    def _bound(self, cap: int, flag: str) -> tuple[int, str]:
        return (cap, flag) if cap <= self.max_queued else (self.max_queued, "--max-queued-requests")

    def check_n(self, n: int) -> None:
        """`n`: samples of each prompt."""
        cap, flag = self._bound(self.max_n, "--max-n")
        if n > cap:
            raise RequestError(f"'n' must be at most {cap} on this server ({flag})", "n")

    def check_prompts(self, prompts: int, n: int, param: str = "prompt") -> None:
        """A request's sequences: its `prompts` (one for chat) times `n`; `param` names its prompt."""
        self.check_n(n)
        cap, flag = self._bound(self.max_prompts, "--max-prompts-per-request")
        if prompts > cap:
            raise RequestError(f"'{param}' may hold at most {cap} prompts on this server ({flag}), got {prompts}",
                               param)
        if prompts * n > cap:
            raise RequestError(f"prompts x n must be at most {cap} on this server ({flag}), got {prompts} x {n}",
                               "n")

    def check_embedding_inputs(self, inputs: int) -> None:
        """/v1/embeddings: its inputs."""
        cap, flag = self._bound(self.max_embedding_inputs, "--max-embedding-inputs")
        if inputs > cap:
            raise RequestError(f"'input' may hold at most {cap} items on this server ({flag}), got {inputs}",
                               "input")


DEFAULT_CAPS = RequestCaps.of(ServerConfig())


# ---- pydantic's errors as OpenAI's ----------------------------------------------------------------------

_MESSAGES = {  # pydantic error type -> what follows the parameter's name
    "missing": "is required", "int_type": "must be an integer", "float_type": "must be a number",
    "finite_number": "must be a finite number", "bool_type": "must be a boolean", "string_type": "must be a string",
    "list_type": "must be a list", "dict_type": "must be an object", "model_type": "must be an object",
    "model_attributes_type": "must be an object", "none_required": "is not supported",
    "literal_error": "must be {expected}", "too_short": "must hold at least {min_length} item(s)",
    "too_long": "may hold at most {max_length} items", "string_too_short": "must have at least {min_length} "
    "character(s)", "string_too_long": "must have at most {max_length} characters",
    "string_pattern_mismatch": "must match the pattern {pattern}",
}


def invalid(e: ValidationError) -> RequestError:
    """The first of pydantic's errors as a 400 naming its parameter by path."""
    err = e.errors(include_url=False)[0]
    param = param_path(tuple(p for p in err["loc"] if p not in TAGS)) or None
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    text = _MESSAGES[kind].format(**ctx) if kind in _MESSAGES else err["msg"]
    if text.startswith("Input should"):
        text = "must" + text.removeprefix("Input should")
    if isinstance(value, (int, float)) and kind not in ("missing", "invalid_value"):
        text += ", got " + (str(value).lower() if isinstance(value, bool) else repr(value))[:40]
    return RequestError(f"'{param}' {text}" if param else text, param)


def _validate(model: type[SamplingRequest], body: dict) -> SamplingRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid(e) from None


# ---- validated models to a GenerateRequest ------------------------------------------------------------

def _common(m: SamplingRequest, body: dict, chat: bool, max_tokens: int | None) -> GenerateRequest:
    """What both endpoints share, and the rules that span fields."""
    n = m.get("n")
    if m.best_of is not None and m.best_of != n:
        raise RequestError("'best_of' different from 'n' is not supported", "best_of")
    stop = m.stop if m.stop is None or isinstance(m.stop, list) else [m.stop]
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=m.get("temperature"), top_p=m.get("top_p"),
        top_k=max(m.get("top_k"), 0),  # -1 (vLLM's "off") and 0 both disable top-k
        min_p=m.get("min_p"), seed=m.seed,
        stop=list(dict.fromkeys(stop or ())), stop_token_ids=m.stop_token_ids or [],
        ignore_eos=m.get("ignore_eos"), min_tokens=m.get("min_tokens"),
        include_stop_str_in_output=m.get("include_stop_str_in_output"),
        structured_output=parse_structured_output(body),
        presence_penalty=m.get("presence_penalty"), frequency_penalty=m.get("frequency_penalty"),
        repetition_penalty=m.get("repetition_penalty"),
        logit_bias={int(k): v for k, v in m.logit_bias.items()} if m.logit_bias else None,
        # deduplicated: its length is then bounded by the vocabulary as well
        allowed_token_ids=list(dict.fromkeys(m.allowed_token_ids)) if m.allowed_token_ids else None,
        bad_words=m.bad_words or [], skip_special_tokens=m.get("skip_special_tokens"), cache_salt=m.cache_salt,
    )
    stream, opts = m.get("stream"), m.stream_options
    if opts is not None and opts.model_fields_set and not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return GenerateRequest(chat=chat, model=m.model, params=params, max_tokens=max_tokens, n=n, stream=stream,
                           include_usage=bool(opts and opts.include_usage), priority=m.get("priority"), user=m.user)


def parse_completion(body: dict, caps: RequestCaps = DEFAULT_CAPS) -> GenerateRequest:
    """Validate a /v1/completions body."""
    m = _validate(CompletionRequest, body)
    if body.get("tools") is not None:
        raise RequestError("'tools' are supported on /v1/chat/completions only", "tools")
    req = _common(m, body, chat=False, max_tokens=m.get("max_tokens"))
    req.params.logprobs = m.logprobs
    req.echo = m.get("echo")
    if req.echo and m.logprobs is not None:
        raise RequestError("'echo' with 'logprobs' (the prompt's logprobs) is not supported", "echo")
    prompt = m.prompt
    one = isinstance(prompt, str) or isinstance(prompt[0], int)  # a text or one list of token ids
    req.prompts = [prompt] if one else prompt
    caps.check_prompts(len(req.prompts), req.n)
    return req


def parse_chat(body: dict, caps: RequestCaps = DEFAULT_CAPS) -> GenerateRequest:
    """Validate a /v1/chat/completions body."""
    m = _validate(ChatCompletionRequest, body)
    max_tokens = m.max_completion_tokens if m.max_completion_tokens is not None else m.max_tokens
    req = _common(m, body, chat=True, max_tokens=max_tokens)
    caps.check_prompts(1, req.n, "messages")
    if m.logprobs:
        req.params.logprobs = m.top_logprobs or 0
    elif m.top_logprobs is not None:
        raise RequestError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    req.tools = parse_tools(body)
    if req.tools is not None and req.tools.active and req.params.structured_output is not None:
        raise RequestError("tools with tool_choice other than 'none' cannot be combined with "
                           f"'{req.params.structured_output.param.split('.')[0]}'", "tool_choice")
    req.messages = _messages(m)
    req.template_kwargs = _template_kwargs(m.chat_template_kwargs)
    return req


def _template_kwargs(v: dict | None) -> dict:
    """chat_template_kwargs: a few named values the chat template may read, never what the server renders."""
    if v is None:
        return {}
    name = "chat_template_kwargs"
    for key in v:
        if not _KWARG_NAME.match(key):
            raise RequestError(f"'{name}' keys must be identifiers of at most 64 characters, got {key[:64]!r}", name)
        if key in TEMPLATE_RESERVED:
            raise RequestError(f"'{name}' may not set '{key}': the server renders it", f"{name}.{key}")
    if len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_BYTES:  # the values are decoded JSON: they encode back
        raise RequestError(f"'{name}' must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON", name)
    return v


def _messages(m: ChatCompletionRequest) -> list[dict]:
    """The messages with text content, developer as system, and history calls in one form."""
    out = []
    for i, msg in enumerate(m.messages):
        where = f"messages[{i}]"
        if msg.content is None and msg.role != "assistant":
            raise RequestError(f"{where}.content is required", f"{where}.content")
        if msg.role == "tool" and msg.tool_call_id is None:
            raise RequestError(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id")
        content = msg.content if isinstance(msg.content, str) else "".join(p.text for p in msg.content or ())
        item = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
        if msg.name is not None:
            item["name"] = msg.name
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls is not None and msg.role == "assistant":
            item["tool_calls"] = [_history_call(c, j) for j, c in enumerate(msg.tool_calls)]
        out.append(item)
    return out


def _history_call(call: HistoryCall, j: int) -> dict:
    args = call.function.arguments  # lenient: some clients send the object itself
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": call.id or f"call_{j}", "type": "function", "function": {"name": call.function.name,
                                                                          "arguments": text}}


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
    max_tokens = max(req.max_tokens if req.max_tokens is not None else max_model_len - n, 1)
    # The API's one exact check (the scheduler's RequestRejected guards in-process callers): before anything is
    # queued, so a prompt that can never run compiles no grammar, queues no n requests to roll back, and is never
    # answered with a 429 its client would retry.
    if n + max_tokens > max_model_len:
        where = "in the messages" if req.chat else "in your prompt"
        raise context_length_error(
            max_model_len, f"you requested {n + max_tokens} tokens ({n} {where}, {max_tokens} for the completion). "
            f"Please reduce the length of the {param} or completion.", param)
    # The one rule the models cannot state: it needs the max_tokens settled here. The values were bounded by the
    # models; SamplingParams.validate, for in-process callers, runs once, in the engine.
    if req.params.min_tokens > max_tokens:
        raise RequestError("min_tokens must not exceed max_tokens", "min_tokens")
    return dataclasses.replace(req.params, max_tokens=max_tokens, stop=list(req.params.stop),
                               stop_token_ids=list(req.params.stop_token_ids))
