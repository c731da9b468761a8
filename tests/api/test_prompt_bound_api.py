"""A megabyte prompt or chat message is refused before the tokenizer sees it, through `sluice serve` with SmolLM2's
tokenizer and its 8,192-token context (on a tiny random-weight model): its widest token covers 81 bytes, so a
megabyte proves more than 12,000 tokens.

The time of a refusal is compared with the server's own time for tokenizing the same text (/tokenize), never with
an absolute figure: on a loaded 2-core machine both slow down together.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.support.server import MODEL, Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MEGABYTE = "word " * 200_000  # 1,000,000 bytes, ~200,000 tokens; its JSON body is under --max-request-body-bytes


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """`sluice serve` on a 2-layer random Llama with SmolLM2's tokenizer, chat template and context."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("smol-tokenizer-model"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    srv = Server(path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "600").wait_ready()
    yield srv
    srv.stop()


def post(srv: Server, route: str, body: dict) -> tuple[int, dict, float]:
    """(status, JSON body, seconds to the answer)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(srv.url + route, data, {"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, out = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, out = e.code, e.read()
    return status, json.loads(out), time.perf_counter() - started


def test_a_megabyte_prompt_or_chat_is_a_400_without_tokenizing_it(server):
    status, out, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello " * 1000, "max_tokens": 2})
    assert status == 200, out  # a prompt that fits is served
    status, out, tokenizing = post(server, "/tokenize", {"model": MODEL, "prompt": MEGABYTE})
    assert status == 200 and out["count"] > 150_000 and out["max_model_len"] == 8192, out["count"]
    words = [{"role": "user", "content": "word " * 20_000}, {"role": "assistant", "content": "word " * 20_000}]
    probes = {
        "prompt": ("/v1/completions", {"model": MODEL, "prompt": MEGABYTE, "max_tokens": 4}, "prompt"),
        "prompt of spaces": ("/v1/completions", {"model": MODEL, "prompt": " " * 1_000_000}, "prompt"),
        "chat message": ("/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": MEGABYTE}]}, "messages"),
        "ten messages of 100 KB": ("/v1/chat/completions", {"model": MODEL, "messages": words * 5}, "messages"),
    }
    times = {}
    for name, (route, body, param) in probes.items():
        status, out, times[name] = post(server, route, body)
        err = out.get("error", {})
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, (name, out)
        assert f"bytes of text in your {param} are at least" in err["message"], (name, err)  # the pre-check's
    print(f"1 MB through the tokenizer: {tokenizing:.3f} s; refused: "
          + ", ".join(f"{name} {t * 1000:.0f} ms" for name, t in times.items()))
    assert max(times.values()) < tokenizing / 4, (tokenizing, times)
    assert "Traceback" not in server.log()
