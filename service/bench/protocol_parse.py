"""`bench protocol`: what validating a request body costs, beside what decoding its JSON costs.

Times `parse_chat` / `parse_completion` (the body already decoded, as the preparation pool has it) on a typical
chat body, a 64-prompt completions body of text and one of token ids, and `orjson.loads` of the same bytes for
scale. With `--baseline REF` the same timing runs in an earlier commit's Sluice (service/bench/baseline.py),
alternating with this one. Run as a script (`python protocol_parse.py`), it prints its figures as JSON: that is
how the baseline's interpreter runs it, so it imports nothing of Sluice but the two parse functions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                             "required": ["city"]}}}
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And its population, roughly?"}]}],
    "max_tokens": 256, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 7, "stream": True,
    "stream_options": {"include_usage": True}, "tools": [TOOL], "tool_choice": "auto"}
WORDS = "the quick brown fox jumps over a lazy dog while the sun sets slowly behind distant hills".split()
TEXTS = {"model": "m", "prompt": [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) for i in range(64)],
         "max_tokens": 16, "temperature": 0.0, "logprobs": 2}
IDS = {"model": "m", "prompt": [[(i * 131 + j * 7) % 49152 for j in range(256)] for i in range(64)],
       "max_tokens": 16, "temperature": 0.0}
BODIES = {"chat, 4 messages and a tool": (True, CHAT), "completions, 64 text prompts": (False, TEXTS),
          "completions, 64 x 256 token ids": (False, IDS)}


def _per_call_us(fn, arg, number: int, rounds: int) -> float:
    """The least over `rounds` of the mean time of `number` calls `fn(arg)`, in microseconds: as timeit, the
    least is the figure a shared machine disturbs least."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn(arg)
        times.append((time.perf_counter() - start) / number * 1e6)
    return min(times)


def parse_times(number: int = 200, rounds: int = 7) -> dict[str, dict[str, float]]:
    """For each body: microseconds to validate it, and to decode its JSON bytes."""
    import orjson

    from sluice.service.api.protocol import parse_chat, parse_completion

    out = {}
    for name, (chat, body) in BODIES.items():
        raw = orjson.dumps(body)
        parse = parse_chat if chat else parse_completion
        decoded = orjson.loads(raw)  # neither version changes the body it validates
        parse(decoded)
        out[name] = {"parse_us": _per_call_us(parse, decoded, number, rounds),
                     "json_us": _per_call_us(orjson.loads, raw, number, rounds), "bytes": len(raw)}
    return out


def compare(baseline: str, number: int, rounds: int, repeats: int = 3, log=print) -> dict:
    """This commit's figures and (with `baseline`) an earlier commit's, alternating; the median of `repeats`."""
    pythons = {"this": sys.executable}
    if baseline:
        from sluice.machine import cache_root
        from sluice.service.bench.baseline import baseline_python

        pythons = {f"@{baseline}": str(baseline_python(baseline, cache_root() / "peers", log)), **pythons}
    runs: dict[str, list[dict]] = {tag: [] for tag in pythons}
    for _ in range(repeats):
        for tag, python in pythons.items():
            done = subprocess.run([python, __file__, str(number), str(rounds)], check=True, capture_output=True,
                                  text=True)
            runs[tag].append(json.loads(done.stdout))
    return {tag: {name: {k: statistics.median(r[name][k] for r in results) for k in results[0][name]}
                  for name in BODIES} for tag, results in runs.items()}


def report_lines(figures: dict) -> list[str]:
    """One line per body: parse and JSON-decode microseconds for each commit."""
    tags = list(figures)
    head = f"{'body':34} {'bytes':>8}" + "".join(f" {'parse us ' + t:>20} {'json us ' + t:>18}" for t in tags)
    lines = [head]
    for name in BODIES:
        row = f"{name:34} {figures[tags[-1]][name]['bytes']:>8}"
        row += "".join(f" {figures[t][name]['parse_us']:>20.1f} {figures[t][name]['json_us']:>18.1f}" for t in tags)
        lines.append(row)
    return lines


if __name__ == "__main__":
    print(json.dumps(parse_times(*(int(a) for a in sys.argv[1:3]))))
