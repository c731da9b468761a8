"""The reply side of tool calling under stress: the incremental JSON scanner, every parser on malformed, deep,
truncated and huge replies (bounded time, no RecursionError, text as the fallback), replies cut by max_tokens, and
streamed pieces that always agree with the finished reply."""

from __future__ import annotations

import json
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.service.api.json_scan import MAX_DEPTH, JsonError, JsonScan
from sluice.service.api.tool_parsers import parse
from tests.support.profiles import examples
from tests.support.tools import reassemble, stream_pieces

PARSERS = ("constrained", "hermes", "llama3_json", "mistral", "json")
PREFIX = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


class Canon:
    """A sink that writes what it is told back as canonical JSON."""

    def __init__(self):
        self.parts = []

    def open(self, kind):
        self.parts.append(kind)

    close = open

    def key(self, text):
        self.parts.append(json.dumps(text, ensure_ascii=False))

    def colon(self):
        self.parts.append(": ")

    def comma(self):
        self.parts.append(", ")

    def string_start(self):
        self.parts.append('"')

    string_end = string_start

    def string_piece(self, text):
        self.parts.append(json.dumps(text, ensure_ascii=False)[1:-1])

    def scalar(self, raw):
        self.parts.append(json.dumps(json.loads(raw)))


def scan_pieces(text: str, cuts: list[int]) -> str:
    sink = Canon()
    scan, buf, last = JsonScan(sink), "", 0
    for cut in [*sorted(cuts), len(text)]:
        buf += text[last:cut]
        last = cut
        buf = buf[scan.feed(buf, 0, final=cut == len(text)):]
    assert scan.done and buf.strip() == ""
    return "".join(sink.parts)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@settings(max_examples=examples(200, 2000), deadline=None)
@given(JSON, st.lists(st.integers(0, 400), max_size=12), st.booleans())
def test_scanner_in_any_pieces_writes_what_json_dumps_writes(value, cuts, ascii_):
    text = json.dumps(value, ensure_ascii=ascii_, indent=1 if ascii_ else None)  # \u escapes, surrogate pairs
    cuts = [c for c in cuts if c <= len(text)]
    assert scan_pieces(text, cuts) == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("bad", ['{"a" 1}', "[1,]", "{,}", '"\\x"', "[1 2]", "01", "tru e", "[}", '{"a":1]'])
def test_scanner_refuses_what_is_not_json(bad):
    with pytest.raises(JsonError):
        JsonScan(Canon()).feed(bad, 0, final=True)


def test_scanner_bounds_depth_without_recursion():
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert scan_pieces(deep, []) == deep
    with pytest.raises(JsonError) as info:
        JsonScan(Canon()).feed("[" * 100_000, 0)
    assert info.value.kind == "deep" and info.value.pos == MAX_DEPTH


N = 100_000
HOSTILE = {
    "open brackets": "[" * N,
    "open braces": "{" * N,
    "unterminated list": "[1, " * (N // 4),
    "name characters": "a" * N,
    "brackets in a string": '{"a": "' + "[" * N,
    "balanced": "[" * 100 + "]" * 100 + "[{}]" * (N // 4),
    "many empty objects": "{} " * (N // 3),
    "mistral v11 noise": "f[ARGS]" * (N // 7),
    "repeated markers": "<tool_call>" * (N // 11),
    "a call then deep args": '{"name": "f", "arguments": ' + "[" * N,
}


@pytest.mark.parametrize("label", HOSTILE)
@pytest.mark.parametrize("parser", PARSERS)
def test_every_parser_survives_hostile_replies_in_bounded_time(parser, label):
    text = PREFIX.get(parser, "") + HOSTILE[label]
    for reason in ("stop", "length"):
        start = time.perf_counter()
        parsed = parse(text, parser, reason)
        took = time.perf_counter() - start
        assert took < 0.5, f"{took:.3f}s"  # ~1 ms on an idle core; generous for a loaded CI machine
        orjson.dumps({"content": parsed.content, "calls": parsed.calls})
        for call in parsed.calls:
            json.loads(call["function"]["arguments"])
    start = time.perf_counter()
    chunks = stream_pieces(parser, [text[i:i + 3] for i in range(0, min(len(text), 30_000), 3)])
    assert time.perf_counter() - start < 2.0  # 10,000 feeds: per-token work stays small
    orjson.dumps([c[:3] for c in chunks])


ONE = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TWO = '{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "d\\u00e9"}]}}'
CUT_REPLIES = {  # four calls were complete when max_tokens cut the fifth
    "constrained": "[" + ", ".join([ONE, TWO] * 2) + ', {"name": "get_weather", "arguments": {"city": "Ro',
    "hermes": "Let me see.\n" + "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in [ONE, TWO] * 2)
              + '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
    "llama3_json": "<|python_tag|>" + "; ".join([ONE, TWO] * 2) + '; {"name": "add", "parameters": {"a": 1',
    "mistral": "[TOOL_CALLS][" + ", ".join([ONE, TWO] * 2) + ', {"name": "add", "arguments": {"a": 1, ',
    "json": "Sure: [" + ", ".join([ONE, TWO] * 2) + ', {"name": "add", "arguments": {"a": ',
}


@pytest.mark.parametrize("parser", PARSERS)
def test_calls_complete_before_the_limit_are_tool_calls(parser):
    text = CUT_REPLIES[parser]
    expected = [json.loads(c) for c in [ONE, TWO] * 2]
    parsed = parse(text, parser, "length")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [
        (e["name"], e["arguments"]) for e in expected]
    assert parsed.content == ("Let me see." if parser == "hermes" else "Sure:" if parser == "json" else "")
    for piece in (1, 4, 13):
        chunks = stream_pieces(parser, [text[i:i + piece] for i in range(0, len(text), piece)], "length")
        got = reassemble(chunks)
        assert [c["function"]["arguments"] for c in got[:4]] == [c["function"]["arguments"] for c in parsed.calls]
        assert len(got) == 5  # the cut call's pieces have gone out; its arguments do not parse
        with pytest.raises(ValueError):
            json.loads(got[4]["function"]["arguments"])
        assert chunks[-1][2] == "length"
        assert "".join(c[0] for c in chunks).strip() == parsed.content


def test_a_cut_before_any_call_is_complete_leaves_no_grammar_text():
    assert parse('{"name": "get_weather", "arguments": {"ci', "constrained", "length").content == ""
    assert parse('[{"name": "get_weather", "argu', "constrained", "length").content == ""
    assert parse("Hi <tool_call>\n{\"name\": \"f\", \"argu", "hermes", "length").content == "Hi"
    # a reply that stopped inside something that is not a call stays text
    assert parse("<tool_call>{not json", "hermes", "stop").content == "<tool_call>{not json"


@pytest.mark.parametrize("parser", PARSERS)
def test_surrogates_and_control_characters_come_out_as_valid_json(parser):
    args = '{"s": "a\\ud800b\\udc00\\ud83d\\ude00' + "\x01\n" + '", "n": 1E400, "m": -0, "x": 1.50}'
    call = f'{{"name": "f\\ud800", "arguments": {args}}}'
    text = PREFIX.get(parser, "") + call
    [parsed] = parse(text, parser).calls
    orjson.dumps(parsed)
    decoded = json.loads(parsed["function"]["arguments"])
    assert decoded["s"] == "a\ud800b\udc00\U0001f600\x01\n" and decoded["m"] == 0 and decoded["x"] == 1.5
    assert parsed["function"]["name"] == "f\ufffd"
    answer = parse('{"content": "x\\ud800y"}', "constrained")
    assert answer.content == "x\ufffdy" and not answer.calls


CALL = st.builds(lambda name, args: {"name": name, "arguments": args},
                 st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
                 st.dictionaries(st.text(max_size=5), JSON, max_size=3))


def render(parser: str, calls: list[dict], prose: str) -> str:
    items = [json.dumps(c, ensure_ascii=False) for c in calls]
    if parser == "constrained":
        return items[0] if len(items) == 1 else "[" + ", ".join(items) + "]"
    if parser == "hermes":
        return prose + "".join(f"<tool_call>\n{i}\n</tool_call>\n" for i in items)
    if parser == "llama3_json":
        return prose + "<|python_tag|>" + "; ".join(items)
    if parser == "mistral":
        return prose + "[TOOL_CALLS]" + "".join(f"{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    return prose + "[" + ", ".join(items) + "]"


@settings(max_examples=examples(60, 600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PARSERS), st.lists(CALL, min_size=1, max_size=3), st.text("ab .\n", max_size=12),
       st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_any_split_of_a_reply_gives_the_calls_of_the_whole(parser, calls, prose, sizes):
    text = render(parser, calls, prose)
    whole = parse(text, parser)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls] == [
        (c["name"], c["arguments"]) for c in calls]
    pieces, i = [], 0
    while i < len(text):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(text[i:i + size])
        i += size
    chunks = stream_pieces(parser, pieces)
    got = reassemble(chunks)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    assert "".join(c[0] for c in chunks).strip() == whole.content == prose.strip() * (parser != "constrained")
