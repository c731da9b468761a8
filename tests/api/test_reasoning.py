"""The reasoning parser (service/api/reasoning.py): every split of a reply across stream pieces reads as the whole
reply does; the plan per template and prompt; chat_template_kwargs validation; the engine's constraint that
waits for the end of the thinking (service/structured/grammar.py: Thinking)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sluice.scheduling.sampling_params import ReasoningSpan, SamplingParams, StructuredOutput
from sluice.service.api.errors import RequestError
from sluice.service.api.protocol import parse_chat
from sluice.service.api.reasoning import (
    Phase,
    ReasoningParser,
    constrain_after,
    detect_parser,
    plan_reasoning,
    split_output,
)
from sluice.service.structured.grammar import Thinking

QWEN3 = (Phase.START, Phase.CONTENT)  # a reply may open with <think>
R1 = (Phase.START, Phase.REASONING)  # a reply starts inside the thinking


def run(pieces: list[str], start=QWEN3) -> tuple[str, str]:
    parser = ReasoningParser(*start)
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


def splits(text: str):
    """Every way to cut `text` in two and in three pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text,start,expected", [
    ("<think>let me see</think>\n\nParis", QWEN3, ("let me see", "Paris")),
    ("<think>a < b and </th is no tag</think>yes", QWEN3, ("a < b and </th is no tag", "yes")),
    ("Paris, no thinking", QWEN3, ("", "Paris, no thinking")),
    ("<thinking> is not the tag", QWEN3, ("", "<thinking> is not the tag")),
    ("<think>cut before the end", QWEN3, ("cut before the end", "")),
    ("<think>ends with half a tag </thi", QWEN3, ("ends with half a tag </thi", "")),
    ("in the thinking already</think>Answer <think> stays", R1, ("in the thinking already", "Answer <think> stays")),
    ("<think>a leading tag is dropped</think>ok", R1, ("a leading tag is dropped", "ok")),
    ("never ends", R1, ("never ends", "")),
    ("<", QWEN3, ("", "<")),
    ("", R1, ("", "")),
    ("</think>", R1, ("", "")),
])
def test_every_split_of_a_reply_reads_as_the_whole(text, start, expected):
    assert run([text], start) == expected
    for pieces in splits(text):
        assert run(pieces, start) == expected, pieces


def test_one_character_at_a_time_and_the_answer_keeps_its_inner_whitespace():
    text = "<think>step 1\nstep 2</think>  \n The answer:\n  42 "
    assert run(list(text)) == ("step 1\nstep 2", "The answer:\n  42 ")


def test_the_parser_holds_back_at_most_a_tag_and_is_linear():
    parser = ReasoningParser(*R1)
    total = 0
    for _ in range(2000):
        r, c = parser.feed("x" * 50 + "</thin")
        total += len(r)
        assert len(parser.held) < len("</think>")
    assert total == 2000 * 56 - 6  # all but the last partial tag went out as it came
    r, c = parser.feed("k>done")
    assert (r, c) == ("", "done")


def test_templates_are_detected():
    assert detect_parser("{{ m.content }}") == "none"
    assert detect_parser("{%- if '</think>' in content %}<|im_start|>assistant\n") == "qwen3"
    assert detect_parser("<｜Assistant｜>{% set c = c.split('</think>')[-1] %}<think>\n") == "deepseek_r1"


class _Tok:
    """Tag ids as a tokenizer with <think> and </think> as added tokens spells them."""

    chat_template = "{% if enable_thinking is false %}<think></think>{% endif %}"

    def __init__(self, multi: bool = False):
        self.multi = multi

    def encode(self, text, add_special_tokens=False):
        if self.multi:
            return [ord(c) for c in text]
        return {"<think>": [301], "</think>": [302]}[text]


def test_the_prompt_decides_where_the_reply_starts():
    tok = _Tok()
    qwen = plan_reasoning("qwen3", tok, "<|im_start|>assistant\n")
    assert (qwen.phase, qwen.otherwise, qwen.span) == (Phase.START, Phase.CONTENT, ReasoningSpan((302,), 301))
    opened = plan_reasoning("qwen3", tok, "<|im_start|>assistant\n<think>\n")
    assert (opened.otherwise, opened.span) == (Phase.REASONING, ReasoningSpan((302,)))
    closed = plan_reasoning("auto", tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (closed.phase, closed.span) == (Phase.CONTENT, None)
    r1 = plan_reasoning("deepseek_r1", tok, "<｜Assistant｜>")
    assert (r1.otherwise, r1.span) == (Phase.REASONING, ReasoningSpan((302,)))
    assert plan_reasoning("none", tok, "x") is None
    assert plan_reasoning("auto", SimpleNamespace(chat_template="{{ m }}"), "x") is None
    # a start tag of several tokens cannot be offered as one first token: the constraint holds from the start
    assert plan_reasoning("qwen3", _Tok(multi=True), "assistant\n").span is None


def test_a_constraint_waits_for_the_plan_span_and_keeps_its_compile_key():
    params = SamplingParams(structured_output=StructuredOutput("json", "{}"))
    plan = plan_reasoning("deepseek_r1", _Tok(), "<｜Assistant｜><think>\n")
    constrain_after(params, plan)
    assert params.structured_output.after_reasoning == ReasoningSpan((302,))
    assert params.structured_output.key == ("json", "{}")
    free = SamplingParams()
    constrain_after(free, plan)
    assert free.structured_output is None


def test_split_output_counts_thinking_tokens():
    from sluice.scheduling.outcomes import FinishReason
    from sluice.service.engine.outputs import EngineOutput

    choice = SimpleNamespace(reasoning=ReasoningParser(*QWEN3), num_reasoning_tokens=0)
    got = []
    for text, finished in [("<think>", False), ("hmm", False), ("</think>", False), ("\n\nHi", False), ("!", True)]:
        out = EngineOutput.tokens("r", text, [1], [], FinishReason.STOP if finished else None, 3, 1, 0)
        r, o = split_output(choice, out)
        got.append((r, o.text, o.finished))
    assert got == [("", "", False), ("hmm", "", False), ("", "", False), ("", "Hi", False), ("", "!", True)]
    assert choice.num_reasoning_tokens == 3  # <think>, hmm, </think>


# ---- chat_template_kwargs --------------------------------------------------------------------------------

def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], **extra}


def test_chat_template_kwargs_are_validated():
    assert (parse_chat(chat(chat_template_kwargs={"enable_thinking": False})).template_kwargs
            == {"enable_thinking": False})
    assert parse_chat(chat()).template_kwargs == {}
    for bad, param in [("yes", "chat_template_kwargs"),
                       ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                       ({"messages": []}, "chat_template_kwargs.messages"),
                       ({"tools": []}, "chat_template_kwargs.tools"), ({"not a name": 1}, "chat_template_kwargs"),
                       ({f"k{i}": i for i in range(33)}, "chat_template_kwargs"),
                       ({"big": "x" * 20000}, "chat_template_kwargs")]:
        with pytest.raises(RequestError) as info:
            parse_chat(chat(chat_template_kwargs=bad))
        assert info.value.param == param, bad


# ---- the engine's side: the constraint waits -------------------------------------------------------------

def test_thinking_ends_at_the_end_sequence_across_tokens():
    t = Thinking(ReasoningSpan((7, 8)))
    assert t.feed(5) and t.feed(7) and not t.done
    assert t.feed(9) and not t.done  # 7 then 9: not the end
    assert t.feed(7) and t.feed(8) and t.done


def test_optional_thinking_is_declined_by_another_first_token():
    assert not Thinking(ReasoningSpan((8,), start=3)).feed(4)
    t = Thinking(ReasoningSpan((8,), start=3))
    assert t.offers_start and t.feed(3) and not t.offers_start
    assert t.feed(8) and t.done
