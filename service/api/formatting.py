"""OpenAI's response and chunk shapes: choices as they accumulate, usage, logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sluice.service.api.protocol import GenerateRequest
from sluice.service.engine.detokenizer import token_bytes

_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass(slots=True)
class Choice:
    """One choice's output as it accumulates."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    text_offset: int = 0  # characters sent so far: completions logprobs' text_offset
    echo: str = ""  # completions with echo: the prompt's text, sent before the output
    tools: object = None  # chat with tools: its tool_parsers.ToolOutput
    tool_calls: list | None = None  # the parsed calls of a non-streamed reply
    reasoning: object = None  # a reasoning model's reply: its reasoning.ReasoningParser
    reasoning_text: list[str] = field(default_factory=list)  # a non-streamed reply's thinking
    num_reasoning_tokens: int = 0


def record(choice: Choice, out) -> None:
    """Fold one engine output's counters into its choice."""
    # Counters are cumulative; keep the largest seen (an abort notice may carry zeros).
    choice.num_prompt_tokens = max(choice.num_prompt_tokens, out.num_prompt_tokens)
    choice.num_output_tokens = max(choice.num_output_tokens, out.num_output_tokens)
    choice.num_cached_tokens = max(choice.num_cached_tokens, out.num_cached_tokens)
    if out.finished:
        choice.finish_reason = out.finish_reason


def usage(choices: dict[str, Choice]) -> dict:
    """OpenAI's usage block for the whole call."""
    prompt = {c.prompt_index: c.num_prompt_tokens for c in choices.values()}  # n samples share one prompt
    cached = {c.prompt_index: c.num_cached_tokens for c in choices.values()}
    completion = sum(c.num_output_tokens for c in choices.values())
    out = {"prompt_tokens": sum(prompt.values()), "completion_tokens": completion,
           "total_tokens": sum(prompt.values()) + completion,
           "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    if any(c.reasoning is not None for c in choices.values()):
        out["completion_tokens_details"] = {"reasoning_tokens": sum(c.num_reasoning_tokens for c in choices.values())}
    return out


class ResponseFormat:
    """OpenAI's response and chunk shapes for one request (text completion or chat)."""

    __slots__ = ("req", "id", "model", "tokenizer", "created")

    def __init__(self, req: GenerateRequest, response_id: str, model: str, tokenizer):
        self.req, self.id, self.model, self.tokenizer = req, response_id, model, tokenizer
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, choice: Choice, text: str, finish_reason: str | None, role: bool = False,
              logprobs=(), tool_calls: list | None = None, reasoning: str = "") -> dict:
        """One SSE chunk for one choice; `reasoning`: a reasoning model's thinking (reasoning_content)."""
        want = self.req.params.logprobs is not None and not role
        lp = self._logprobs(logprobs, choice.text_offset) if want else None
        if self.req.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            if tool_calls:  # [{"index", "id", "type", "function": {"name", "arguments"}}]
                delta["tool_calls"] = tool_calls
            if reasoning:  # vLLM's reasoning_content, and reasoning as its newer releases name it
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            body = {**self._head("chat.completion.chunk"), "choices": [
                {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}
        else:
            body = {**self._head("text_completion"), "choices": [
                {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": finish_reason}]}
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, just usage."""
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def response(self, choices: list[Choice], usage: dict) -> dict:
        """The non-streaming response body."""
        out = []
        for c in choices:
            text = c.echo + "".join(c.text)
            lp = self._logprobs(c.logprobs, 0) if self.req.params.logprobs is not None else None
            if self.req.chat:
                message = {"role": "assistant", "content": text}
                if c.tool_calls:  # OpenAI: content null unless the model wrote text before the calls
                    message = {"role": "assistant", "content": text or None, "tool_calls": c.tool_calls}
                if c.reasoning is not None:
                    message["reasoning_content"] = message["reasoning"] = "".join(c.reasoning_text) or None
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {**self._head("chat.completion" if self.req.chat else "text_completion"), "choices": out,
                "usage": usage}

    def _logprobs(self, items, text_offset: int) -> dict:
        """Chat: {"content": [...]} entries; completions: the legacy parallel arrays."""
        decode = self._token_text
        if self.req.chat:
            return {"content": [{
                "token": decode(t.token_id), "logprob": max(t.logprob, _MIN_LOGPROB),
                "bytes": list(token_bytes(self.tokenizer, t.token_id)),
                "top_logprobs": [{"token": decode(i), "logprob": max(lp, _MIN_LOGPROB),
                                  "bytes": list(token_bytes(self.tokenizer, i))} for i, lp in t.top],
            } for t in items]}
        tokens = [decode(t.token_id) for t in items]
        offsets = []
        for tok in tokens:
            offsets.append(text_offset)
            text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [max(t.logprob, _MIN_LOGPROB) for t in items],
                "top_logprobs": [{decode(i): max(lp, _MIN_LOGPROB) for i, lp in t.top} for t in items],
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
