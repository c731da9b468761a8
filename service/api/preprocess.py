"""From request body to engine requests, off the event loop: parse, validate, render the chat template, tokenize.

Each of these can take seconds on a hostile 1 MB body (128 tool schemas checked against the JSON-schema meta
schema, a megabyte of text through the tokenizer), and on the event loop every other stream would pause that long.
So a handler only reads the bytes; the rest runs in a small pool of its own whose queue is bounded, and a prompt
whose text alone proves it longer than the context is refused before the tokenizer sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar

from sluice.cpu import BACKGROUND_NICENESS, lower_priority
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api import json_codec
from sluice.service.api.errors import ApiErrorCode, RequestError, context_length_error, param_path
from sluice.service.api.formatting import Choice
from sluice.service.api.protocol import (
    DEFAULT_CAPS,
    GenerateRequest,
    RequestCaps,
    parse_chat,
    parse_completion,
    resolve_params,
)
from sluice.service.api.reasoning import constrain_after, plan_reasoning
from sluice.service.api.tool_parsers import ToolOutput
from sluice.service.api.tools import ToolPlan, plan_tools, template_args
from sluice.service.engine.async_engine import ModelInfo

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
                               code=ApiErrorCode.RATE_LIMIT_EXCEEDED, headers={"Retry-After": "1"})
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

def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode): the character each byte is spelled with, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


_BYTE_OF = _byte_of_char()
_WHITESPACE_BYTES = {b for c in map(chr, range(0x3001)) if c.isspace() for b in c.encode()}  # Unicode's, all < U+3001


@dataclass(frozen=True, slots=True)
class PromptBound:
    """How many bytes of text one token can cover: `measure(text)` gives a count of tokens that no encoding of the
    text goes below, in one pass over its bytes.

    Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each character of a vocabulary entry stands for one byte, and
    an added token covers its text's UTF-8 bytes; `width[b]` is the longest token holding byte b. A token of n
    bytes holds only bytes whose width is at least n, so weighing each byte b of the text 1/width[b], a token's
    bytes weigh at most 1 and the text's weigh at most its number of tokens (a byte no token holds weighs 0). Other
    tokenizers: one width for every byte, the UTF-8 length of the longest token's display form (SentencePiece's
    "▁" is 3 bytes for 1, "<0x41>" 6 for 1, an unknown character at most 4). `widest` 0: a token may cover any
    length (WordPiece's or a fused unknown token, a slow tokenizer's), so nothing is refused before encoding. A
    tokenizer with a normalizer is measured on the normalized text, which is what its tokens cover.
    """

    widest: int  # the most bytes one token covers
    classes: bytes | None = None  # byte -> index into `widths` (a bytes.translate table); None: all are `widest`
    widths: tuple[int, ...] = ()
    normalizer: object = None

    def measure(self, text: str) -> tuple[int, int]:
        """(UTF-8 bytes of `text`, the fewest tokens they can be)."""
        data = raw = text.encode("utf-8", "replace")
        if not self.widest:
            return len(raw), 0
        if self.normalizer is not None:
            data = self.normalizer.normalize_str(text).encode("utf-8", "replace")
        if self.classes is None:
            return len(raw), -(-len(data) // self.widest)
        classed = data.translate(self.classes)
        weight = sum((Fraction(classed.count(i), w) for i, w in enumerate(self.widths) if w), Fraction(0))
        return len(raw), math.ceil(weight)


_BOUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOUND_LOCK = threading.Lock()


def prompt_bound(tokenizer) -> PromptBound:
    """The tokenizer's PromptBound, computed once (~0.3 s for a 50k vocabulary: `sluice serve` does it at start)."""
    with _BOUND_LOCK:
        bound = _BOUNDS.get(tokenizer)
        if bound is None:
            bound = _BOUNDS[tokenizer] = _bound_of(tokenizer)
        return bound


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token (special tokens included) covers; 0 when nothing bounds it."""
    return prompt_bound(tokenizer).widest


def _bound_of(tokenizer) -> PromptBound:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: its rules are its own code, nothing here bounds them
        return PromptBound(0)
    spec = json.loads(backend.to_str())
    model, normalizer = spec["model"], backend.normalizer
    if "ByteLevel" in json.dumps(spec.get("normalizer")):
        return PromptBound(0)  # bytes spelled as characters before the normalizer's other steps: not measured here
    added = {a["content"] for a in spec.get("added_tokens") or ()}
    # an added token that strips takes in the whitespace beside it, of any length
    strips = any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or ())
    # an added token is matched in the text as given, or once normalized: either way it covers its text's bytes
    texts = [t.encode() for t in added | ({normalizer.normalize_str(t) for t in added} if normalizer else set())]
    kind, vocab = model.get("type"), model.get("vocab") or {}
    if kind == "BPE" and "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
        try:
            texts += [bytes(_BYTE_OF[c] for c in piece) for piece in vocab if piece not in added]
        except KeyError:  # a character outside the byte alphabet: not byte-level after all
            pass
        else:
            width = [0] * 256
            for data in texts:
                for b in set(data):
                    width[b] = max(width[b], len(data))
            for b in _WHITESPACE_BYTES if strips else ():
                width[b] = 0
            widths = (0, *sorted(set(width) - {0}))
            return PromptBound(max(widths), bytes(widths.index(w) for w in width), widths, normalizer)
    if strips:
        return PromptBound(0)
    pieces = [piece for piece, _ in vocab] if kind == "Unigram" else list(vocab)
    # An unknown character must be a token of its own (<unk>, at most 4 bytes) or its bytes' (<0x41>): a fused unk
    # stands for a run of any length, WordPiece's for a whole word, and BPE without either drops the character.
    falls_back = model.get("byte_fallback") and {f"<0x{b:02X}>" for b in range(256)} <= set(pieces)
    if not (falls_back or (kind == "BPE" and model.get("unk_token") and not model.get("fuse_unk"))):
        return PromptBound(0)
    widest = max([*(len(p.encode("utf-8", "replace")) for p in pieces), *map(len, texts)], default=1)
    return PromptBound(max(4, widest), normalizer=normalizer)


def refuse_if_longer_than_context(text: str, tokenizer, max_model_len: int, param: str) -> None:
    """Refuse text that cannot fit the context whatever its tokens are, before paying for tokenizing it (measured
    byte by byte against what the tokenizer's tokens cover)."""
    num_bytes, least_tokens = prompt_bound(tokenizer).measure(text)
    if least_tokens + 1 > max_model_len:
        raise context_length_error(max_model_len, f"the {num_bytes} bytes of text in your {param} are at least "
                                   f"{least_tokens} tokens. Please reduce the length of the {param}.", param)


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
        raise RequestError(f"the model '{name}' does not exist", "model", ApiErrorCode.MODEL_NOT_FOUND)
    return lora


def prepare_generate(raw: bytes, chat: bool, model: ModelInfo, tool_call_parser: str,
                     reasoning_parser: str = "none", caps: RequestCaps = DEFAULT_CAPS) -> Prepared:
    """Everything between the body's bytes and `AsyncEngine.add_requests` (runs in the Preprocessor's pool);
    `caps`: the server's bounds on n and prompt lists."""
    body = load_body(raw)
    req = parse_chat(body, caps) if chat else parse_completion(body, caps)
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
        # the prompt as the tokenizer will see it, measured whole: every message, the tools' text, the template's
        text = chat_prompt_text(tokenizer, req.messages, plan, template_kwargs=req.template_kwargs)
        refuse_if_longer_than_context(text, tokenizer, max_len, "messages")
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
        reasoning = plan_reasoning(reasoning_parser, tokenizer, text)
        constrain_after(req.params, reasoning)  # a response_format or tool grammar holds after the thinking
    else:
        for p in req.prompts:
            if isinstance(p, str):
                refuse_if_longer_than_context(p, tokenizer, max_len, "prompt")
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
