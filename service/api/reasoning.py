"""Reasoning models on /v1/chat/completions: a reply's thinking (`<think>...</think>`) apart from its answer.

`--reasoning-parser` names the model family, or `auto` detects it from the chat template:
- `qwen3`: a reply may open with `<think>`; one that does not is all content (thinking disabled, or a model
  that answered at once);
- `deepseek_r1`: a reply starts inside the thinking (a leading `<think>` is dropped) and ends it with
  `</think>`.
Either way the rendered prompt has the last word: a prompt that ends by opening `<think>` (DeepSeek-R1's template,
Qwen3's thinking-only models) starts the reply inside the thinking, one that ends with `</think>` (Qwen3 with
`enable_thinking: false`) starts it in the answer.

The thinking goes to `reasoning_content` (and `reasoning`, newer vLLM's name), the rest to `content`, where the
tool parsers read it. A reply cut before `</think>` is all thinking. A constraint (response_format, a tool
grammar) holds from the end of the thinking: `ReasoningSpan` tells the engine which tokens end it.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass

from sluice.scheduling.sampling_params import ReasoningSpan
from sluice.service.api.tools import template_text

PARSERS = ("none", "auto", "qwen3", "deepseek_r1")
START_TAG, END_TAG = "<think>", "</think>"


class Phase(enum.Enum):
    """Where a reply's text is."""

    START = "start"  # nothing read yet: the reply may open with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """Splits one reply, fed in pieces as it is generated, into reasoning and content.

    Linear in the text and bounded: it holds back at most a tag's length (a tag split across pieces)."""

    __slots__ = ("phase", "otherwise", "held", "trim")

    def __init__(self, phase: Phase = Phase.START, otherwise: Phase = Phase.CONTENT):
        self.phase = phase
        self.otherwise = otherwise  # where a reply that does not open with the start tag is
        self.held = ""  # a tail that may be the beginning of a tag
        self.trim = False  # the answer's leading whitespace (after `</think>`) is dropped

    @property
    def thinking(self) -> bool:
        """Whether the text read so far ends inside the thinking (or may, before the first piece)."""
        return self.phase is Phase.REASONING or (self.phase is Phase.START and self.otherwise is Phase.REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) this piece of the reply completes."""
        reasoning, content = "", ""
        text, self.held = self.held + text, ""
        while text:
            if self.phase is Phase.START:
                if text.startswith(START_TAG):
                    text, self.phase = text[len(START_TAG):], Phase.REASONING
                elif START_TAG.startswith(text):
                    self.held = text
                    break
                else:
                    self.phase = self.otherwise
            elif self.phase is Phase.REASONING:
                end = text.find(END_TAG)
                if end < 0:
                    keep = _partial_tag(text, END_TAG)
                    reasoning += text[:len(text) - keep]
                    self.held = text[len(text) - keep:]
                    break
                reasoning += text[:end]
                text, self.phase, self.trim = text[end + len(END_TAG):], Phase.CONTENT, True
            else:
                if self.trim:
                    text = text.lstrip()
                    self.trim = not text
                content += text
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back when the reply ends: a tag that never completed is text."""
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---- per request: which parser, where the reply starts, what the engine needs ---------------------------

def detect_parser(template: str) -> str:
    """The reasoning format a chat template implies: 'none' unless it knows `</think>`."""
    if END_TAG not in template:
        return "none"
    return "deepseek_r1" if "｜Assistant｜" in template else "qwen3"


@dataclass(slots=True)
class ReasoningPlan:
    """How one chat request's reply is split: its parser's start, and the span a constraint waits for."""

    phase: Phase
    otherwise: Phase
    span: ReasoningSpan | None  # None: a constraint holds from the first token

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.phase, self.otherwise)


_TAG_IDS: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
_TAG_LOCK = threading.Lock()


def _tag_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the start and end tags, once per tokenizer."""
    key = id(tokenizer)
    with _TAG_LOCK:
        if key not in _TAG_IDS:
            _TAG_IDS[key] = tuple(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in (START_TAG, END_TAG))
        return _TAG_IDS[key]


def plan_reasoning(flag: str, tokenizer, prompt: str) -> ReasoningPlan | None:
    """The plan for a reply to the rendered `prompt` under `--reasoning-parser flag`; None when off."""
    name = detect_parser(template_text(tokenizer)) if flag == "auto" else flag
    if name == "none":
        return None
    start_ids, end_ids = _tag_ids(tokenizer)
    tail = prompt.rstrip()
    if tail.endswith(END_TAG):  # the template closed the thinking (e.g. enable_thinking: false)
        return ReasoningPlan(Phase.CONTENT, Phase.CONTENT, None)
    if tail.endswith(START_TAG) or name == "deepseek_r1":
        return ReasoningPlan(Phase.START, Phase.REASONING, ReasoningSpan(end_ids) if end_ids else None)
    # qwen3: optional thinking. A constraint offers the start tag as the first token only when it is one token.
    optional = end_ids and len(start_ids) == 1
    return ReasoningPlan(Phase.START, Phase.CONTENT, ReasoningSpan(end_ids, start_ids[0]) if optional else None)


def constrain_after(params, plan: ReasoningPlan | None) -> None:
    """Make the request's constraint (if any) wait for the end of the thinking."""
    so = params.structured_output
    if plan is not None and plan.span is not None and so is not None:
        params.structured_output = dataclasses.replace(so, after_reasoning=plan.span)


# ---- replies --------------------------------------------------------------------------------------------

def split_output(choice, out):
    """One engine output of a choice (formatting.Choice) read by its parser: (reasoning text, the output with
    only the content as its text). The output's tokens count as reasoning while the reply is thinking."""
    parser = choice.reasoning
    if parser is None:
        return "", out
    was_thinking = parser.thinking
    reasoning, content = parser.feed(out.text)
    if out.finished:
        more = parser.finish()
        reasoning, content = reasoning + more[0], content + more[1]
    if was_thinking or parser.thinking:
        choice.num_reasoning_tokens += len(out.token_ids)
    if reasoning or content != out.text:
        out = dataclasses.replace(out, text=content)
    return reasoning, out
