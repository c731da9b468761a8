"""Tool-calling helpers shared by the parser, stream and API tests: a tools-aware template, stream reassembly."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

from sluice.service.api.tool_parsers import ToolOutput, stream_deltas

NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reassemble(chunks) -> list[dict]:
    """Tool-call deltas joined by index as the openai client does; checks OpenAI's delta shapes on the way."""
    calls: dict[int, dict] = {}
    for _, deltas, _, _ in chunks:
        for d in deltas or []:
            if d["index"] not in calls:  # the first delta: id, type, name and empty arguments
                assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"function": {"name": d["function"]["name"], "arguments": ""}, "pieces": 0}
            else:  # later ones: arguments only
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
                calls[d["index"]]["pieces"] += 1
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def stream_pieces(parser: str, pieces: list[str], reason: str = "stop") -> list:
    tools = ToolOutput(parser)
    outs = [SimpleNamespace(text=p, logprobs=[], finished=False, finish_reason=None) for p in pieces]
    outs[-1].finished, outs[-1].finish_reason = True, reason
    return [c for out in outs for c in stream_deltas(tools, out)]


def long_tiny(model_dir: str, path, template: str | None = None) -> str:
    """The tiny model with room for a tool prompt (its byte-level tokenizer spends a token per character or
    so), optionally with another chat template."""
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    if template is not None:
        tok = json.loads((path / "tokenizer_config.json").read_text())
        tok.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(tok))
        (path / "chat_template.jinja").write_text(template)
    return str(path)
