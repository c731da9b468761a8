"""From request body to engine requests, off the event loop: parse, validate, render the chat template, tokenize.

Each of these can take seconds on a hostile 1 MB body (128 tool schemas checked against the JSON-schema meta
schema, a megabyte of text through the tokenizer), and on the event loop every other stream would pause that long.
So a handler only reads the bytes; the rest runs in a small pool of its own whose queue is bounded, and a prompt
whose text alone proves it longer than the context is refused before the tokenizer sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api import json_codec
from sluice.service.api.errors import RequestError, param_path
from sluice.service.api.formatting import Choice
from sluice.service.api.protocol import GenerateRequest, parse_chat, parse_completion, resolve_params
from sluice.service.api.reasoning import constrain_after, plan_reasoning
from sluice.service.api.tool_parsers import ToolOutput
from sluice.service.api.tools import ToolPlan, plan_tools, template_args
from sluice.service.engine.async_engine import ModelInfo
from sluice.service.engine.cpu import BACKGROUND_NICENESS, lower_priority

MAX_BODY_DEPTH = 256  # JSON nesting of a whole body, far below Python's recursion limit; schemas have a lower one
_PARAM_DEPTH = 4  # path components an error's `param` names: `tools[0].function.parameters`
T = TypeVar("T")


class Preprocessor:
    """A bounded pool for request preparation: `max_pending` calls queued or running, more get a 429."""

    def __init__(self, max_workers: int = 2, max_pending: int = 64, niceness: int = BACKGROUND_NICENESS):
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sluice-prep",
                                            initializer=lower_priority, initargs=(niceness,))
        self.max_pending = max_pending
        self._pending = 0

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the pool; RequestError 429 when too many preparations are already queued."""
        if self._pending >= self.max_pending:
            raise RequestError(f"more than {self.max_pending} requests are being prepared; retry shortly",
                               status=429, type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._pending -= 1

    def shutdown(self) -> None:
        """Stop the pool's threads once their current work is done."""
        self._executor.shutdown(wait=False, cancel_futures=True)


# ---- the body ---------------------------------------------------------------------------------------

def load_body(raw: bytes) -> dict:
    """The JSON object of a request body, nested at most MAX_BODY_DEPTH deep; RequestError otherwise."""
    try:
        body = json_codec.loads(raw)
    except json_codec.JSONDecodeError as e:
        deep = "depth limit" in str(e) or "recursion" in str(e).lower()
        raise RequestError(f"the request body is nested more than {MAX_BODY_DEPTH} levels deep" if deep
                           else "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_depth(body, MAX_BODY_DEPTH)
    return body


def check_depth(value, limit: int) -> None:
    """RequestError naming where `value` nests deeper than `limit` (an explicit stack: no recursion)."""
    stack: list[tuple[object, int, tuple]] = [(value, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            where = param_path(path[:_PARAM_DEPTH])
            raise RequestError(f"'{where}' is nested more than {limit} levels deep", where or None)
        if isinstance(node, dict):
            stack.extend((v, depth + 1, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, (*path, i)) for i, v in enumerate(node))


# ---- prompt bounds --------------------------------------------------------------------------------------

_MAX_TOKEN_BYTES: dict[int, int] = {}
_BOUND_LOCK = threading.Lock()


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any one token (special tokens included) spells: text of B bytes is at least
    B / this many tokens. Computed once per tokenizer."""
    key = id(tokenizer)
    with _BOUND_LOCK:
        if key not in _MAX_TOKEN_BYTES:
            pieces = [t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t]
            _MAX_TOKEN_BYTES[key] = max(1, max((len(p.encode("utf-8", "replace")) for p in pieces), default=1))
        return _MAX_TOKEN_BYTES[key]


def refuse_if_longer_than_context(num_bytes: int, tokenizer, max_model_len: int, param: str) -> None:
    """Refuse text that cannot fit the context whatever its tokens are, before paying for tokenizing it."""
    least_tokens = -(-num_bytes // max_token_bytes(tokenizer))
    if least_tokens + 1 > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} holds "
            f"{num_bytes} bytes of text, which is at least {least_tokens} tokens. Please reduce the length of "
            f"the {param}.", param, code="context_length_exceeded")


# ---- a generate request ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Prepared:
    """A validated, tokenized generate call: its engine requests and the choices their outputs fill."""

    req: GenerateRequest
    prefix: str  # the response id
    batch: list[tuple[str, list[int], SamplingParams]]
    choices: dict[str, Choice]


def check_model(name, model: ModelInfo):
    """The LoRA adapter the request's `model` names (None: the base model); 404 for a name not served."""
    if name is None or name == model.served_model_name:
        return None
    lora = None if model.loras is None else model.loras.get(name)
    if lora is None:
        raise RequestError(f"the model '{name}' does not exist", "model", status=404, code="model_not_found")
    return lora


def prepare_generate(raw: bytes, chat: bool, model: ModelInfo, tool_call_parser: str,
                     reasoning_parser: str = "none") -> Prepared:
    """Everything between the body's bytes and `AsyncEngine.add_requests` (runs in the Preprocessor's pool)."""
    body = load_body(raw)
    req = parse_chat(body) if chat else parse_completion(body)
    return prepare_request(req, model, tool_call_parser, reasoning_parser)


def prepare_request(req: GenerateRequest, model: ModelInfo, tool_call_parser: str, reasoning_parser: str = "none",
                    prefix: str | None = None) -> Prepared:
    """A validated request rendered, tokenized and checked against the model; `prefix`: its response id."""
    lora = check_model(req.model, model)
    chat = req.chat
    tokenizer, max_len = model.tokenizer, model.max_model_len
    plan = plan_tools(req, tokenizer, tool_call_parser) if chat else None
    reasoning = None
    if chat:
        refuse_if_longer_than_context(_chat_bytes(req, plan), tokenizer, max_len, "messages")
        text = chat_prompt_text(tokenizer, req.messages, plan, template_kwargs=req.template_kwargs)
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
        reasoning = plan_reasoning(reasoning_parser, tokenizer, text)
        constrain_after(req.params, reasoning)  # a response_format or tool grammar holds after the thinking
    else:
        for p in req.prompts:
            if isinstance(p, str):
                refuse_if_longer_than_context(len(p.encode("utf-8", "replace")), tokenizer, max_len, "prompt")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
    prefix = prefix or ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
    batch, choices = [], {}
    for p, ids in enumerate(prompts):
        params = resolve_params(req, ids, max_len, model.vocab_size)
        if lora is not None:
            params.lora_request = lora
        for i in range(req.n):
            index = p * req.n + i
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            batch.append((f"{prefix}-{index}", ids, seeded))
            choices[f"{prefix}-{index}"] = Choice(index, p, echo=_echo_text(req, p, ids, tokenizer),
                                                  tools=ToolOutput(plan.parser) if plan and plan.active else None,
                                                  reasoning=reasoning.parser() if reasoning else None)
    return Prepared(req, prefix, batch, choices)


def _chat_bytes(req: GenerateRequest, plan: ToolPlan | None) -> int:
    """UTF-8 bytes of the messages' text and of the tools' JSON: the rendered prompt holds at least these (a
    template that knows tools renders them, and the prompted path writes them into the system prompt)."""
    size = sum(len((m.get("content") or "").encode("utf-8", "replace")) for m in req.messages)
    if plan is not None and plan.active:
        size += sum(len(json_codec.dumps(f)) for f in plan.spec.functions)
    return size


def _echo_text(req: GenerateRequest, p: int, ids: list[int], tokenizer) -> str:
    if not req.echo:
        return ""
    prompt = req.prompts[p]
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def chat_prompt_ids(tokenizer, messages: list[dict], plan: ToolPlan | None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """Render the model's chat template; its special tokens are in the text, so by default none are added again."""
    text = chat_prompt_text(tokenizer, messages, plan, add_generation_prompt, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt_text(tokenizer, messages: list[dict], plan: ToolPlan | None, add_generation_prompt: bool = True,
                     template_kwargs: dict | None = None) -> str:
    """The model's chat template rendered; `template_kwargs` (validated chat_template_kwargs) are its variables."""
    kwargs: dict = dict(template_kwargs or {})
    if plan is not None:
        messages, tool_kwargs = template_args(plan, messages)  # tools: native template arguments or prompt text
        kwargs.update(tool_kwargs)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # jinja raises for what the template refuses (role order, missing template, ...)
        raise RequestError(f"the chat template rejected the messages: {e}", "messages") from None
