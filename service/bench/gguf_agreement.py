"""Sluice serving a GGUF file's blocks as stored beside llama.cpp's llama-server on the same file: resident weights
against the file size, process RSS, and greedy agreement: identical tokens until the first divergence, and
teacher-forced (at each position of llama.cpp's reply, given its tokens so far, whether Sluice picks its next one).
A third server, Sluice in float32 on the same file's weights dequantized (gguf's dequantize), picks at the
same positions: how often each integer path agrees with float arithmetic on the very same weights tells whose
rounding moves the other's picks.

    python -m sluice.service.bench.gguf_agreement FILE.gguf [--llama-server PATH] [--max-tokens 64]

Each server runs alone in turn (Sluice first), `--threads` threads each, temperature 0. Prompts are chat messages
rendered by Sluice's /tokenize (the file's chat template); both servers get the same token ids; llama.cpp's reply
comes back as token ids, Sluice's as its tokenizer re-encodes its text. Sluice starts again for the teacher-forced
pass (one-token completions, the prefix cache keeps them cheap). Small and short: a handful of prompts, 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

from sluice.machine import cache_root
from sluice.service.bench.server_process import ServerProcess

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU cache is.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
]
RESIDENT = re.compile(r"GGUF \S+: ([\d.]+ [MG]iB) resident weights for a ([\d.]+ [MG]iB) file \(([\d.]+)x\)")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(gguf: Path, llama_server: Path, max_tokens: int, threads: int, workdir: Path) -> dict:
    """Both servers on `gguf`; the figures as a dict."""
    serve = [sys.executable, "-m", "sluice.service.cli", "serve", "--model", str(gguf), "--max-model-len", "2048",
             "--num-kv-blocks", "256"]
    sluice = [*serve, "--quantization", "gguf"]
    out: dict = {"file": str(gguf), "file_mib": gguf.stat().st_size / 2**20, "prompts": []}
    with ServerProcess(sluice, "/ready", workdir / "sluice.log") as server:
        out["sluice_rss_mib_loaded"] = server.rss_mib()
        prompts, sluice_texts = [], []
        for text in PROMPTS:
            ids = _post(server.base + "/tokenize", {"messages": [{"role": "user", "content": text}]})["tokens"]
            prompts.append(ids)
            reply = _post(server.base + "/v1/completions", {"prompt": ids, "max_tokens": max_tokens,
                                                            "temperature": 0, "ignore_eos": True})
            sluice_texts.append(reply["choices"][0]["text"])
        out["sluice_rss_mib_after"] = server.rss_mib()
        out["sluice_texts"] = sluice_texts
        found = RESIDENT.search(server.log.read_text())
        if found:
            out["resident_weights"], out["file_size"], out["resident_over_file"] = found.groups()

        def encode(text: str) -> list[int]:
            return _post(server.base + "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

        sluice_ids = [encode(t) for t in sluice_texts]
        if not llama_server.is_file():  # Sluice's figures alone
            out["llama_server"] = f"not found: {llama_server}"
            return out
        peer = [str(llama_server), "-m", str(gguf), "-t", str(threads), "-c", "2048", "--parallel", "1"]
        with ServerProcess(peer, "/health", workdir / "llama-server.log") as llama:
            out["llama_server_rss_mib"] = llama.rss_mib()
            for ids, ours_text, ours in zip(prompts, sluice_texts, sluice_ids, strict=True):
                reply = _post(llama.base + "/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0,
                                                           "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                                                           "return_tokens": True})
                theirs = reply.get("tokens") or encode(reply["content"])
                out["prompts"].append({"agree": _common_prefix(ours, theirs), "sluice_tokens": len(ours),
                                       "llama_tokens": len(theirs), "llama_ids": theirs, "sluice": ours_text,
                                       "llama.cpp": reply["content"]})
    picks = {}
    for name, command in (("sluice", sluice), ("float", [*serve, "--dtype", "float32", "--quantization", "none"])):
        with ServerProcess(command, "/ready", workdir / f"{name}-forced.log") as server:
            picks[name] = forced_picks(server.base, prompts, out["prompts"])
            if name == "sluice":
                picks["llama.cpp"] = [[_detokenize(server.base, t) for t in p["llama_ids"]] for p in out["prompts"]]
    for result, ours, theirs in zip(out["prompts"], picks["sluice"], picks["llama.cpp"], strict=True):
        result["forced_agree"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
    agree = [p["agree"] for p in out["prompts"]] or [0]
    out["agreement"] = {"min": min(agree), "mean": sum(agree) / len(agree), "full": sum(a >= max_tokens - 1
                                                                                          for a in agree)}
    out["forced_agreement"] = _agreement(picks["sluice"], picks["llama.cpp"])
    out["forced_agreement_with_float"] = {name: _agreement(picks[name], picks["float"])
                                          for name in ("sluice", "llama.cpp")}
    return out


def _agreement(a: list[list[str]], b: list[list[str]]) -> float:
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


_texts: dict[tuple[str, int], str] = {}


def _detokenize(base: str, token: int) -> str:
    if (base, token) not in _texts:
        _texts[base, token] = _post(base + "/detokenize", {"tokens": [token]})["prompt"]
    return _texts[base, token]


def forced_picks(base: str, prompts: list[list[int]], results: list[dict]) -> list[list[str]]:
    """Teacher-forced picks: at every position of llama.cpp's reply, given llama.cpp's own tokens before it, the
    text of the server's greedy next token. One divergence no longer hides every later position."""
    picks = []
    for ids, result in zip(prompts, results, strict=True):
        theirs = result["llama_ids"]
        picks.append([_post(base + "/v1/completions", {"prompt": ids + theirs[:i], "max_tokens": 1, "temperature": 0,
                                                       "ignore_eos": True})["choices"][0]["text"]
                      for i in range(len(theirs))])
    return picks


def main(argv: list[str] | None = None) -> None:
    """Command line: print the figures as JSON (and write them beside the logs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--llama-server", type=Path, default=cache_root() / "peers" / "llama-server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where the server logs and the JSON go")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gguf-agreement-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = run(args.gguf.expanduser(), args.llama_server.expanduser(), args.max_tokens, args.threads, workdir)
    (workdir / f"{args.gguf.stem}.json").write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k != "prompts"}
    summary["agree_per_prompt"] = [p["agree"] for p in result["prompts"]]
    summary["forced_agree_per_prompt"] = [f"{p['forced_agree']}/{p['llama_tokens']}" for p in result["prompts"]]
    summary["sluice_texts"] = [text[:60] for text in result.get("sluice_texts", [])]
    print(json.dumps(summary, indent=1))
    print(f"details and server logs in {workdir}")


if __name__ == "__main__":
    main()
