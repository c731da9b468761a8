"""The server and `make gpu-check` on a bare GPU image: torch, transformers, aiohttp, uvloop and prometheus-client
alone. orjson, xgrammar, gguf, jsonschema_rs and ninja are hidden (tests/support/bare_serve.py): the server
still serves, JSON still follows orjson's rules, and a request that needs a missing package gets a clear 400."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from sluice.service.api import json_codec
from tests.support import REPO
from tests.support.server import MODEL, Server


def _post(srv: Server, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(srv.url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def bare(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("bare"), "--num-kv-blocks", "64", bare=True).wait_ready()
    yield srv
    srv.stop()


def test_the_bare_server_serves_and_refuses_what_it_cannot(bare):
    status, reply = _post(bare, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "héllo", "max_tokens": 4, "temperature": 0, "logprobs": 2}).encode())
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
    status, reply = _post(bare, "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "response_format": {"type": "json_object"}}).encode())
    assert status == 400 and reply["error"]["code"] == "grammar_unavailable", reply
    assert reply["error"]["param"] == "response_format" and "xgrammar" in reply["error"]["message"]
    status, reply = _post(bare, "/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}')
    assert status == 400 and reply["error"]["message"] == "the request body is not valid JSON", reply
    status, reply = _post(bare, "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and "nested" in reply["error"]["message"], reply
    log = bare.log()
    assert "no ninja to build them with" in log and "Traceback" not in log


def test_gpu_check_imports_on_a_bare_image():
    code = ("import sys; sys.modules['pydantic'] = None; "  # the server's protocol needs it, gpu-check does not
            "from tests.support.bare_serve import hide_optional; hide_optional(); "
            "import sluice.service.bench.gpu_check as g; print(g.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "gpu_check" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("value", [{"a": [1, 2.5, "é", None, True]}, [[[]]], "x"])
def test_the_standard_library_codec_matches_orjson(monkeypatch, value):
    with_orjson = json_codec.dumps(value)
    monkeypatch.setattr(json_codec, "orjson", None)
    assert json_codec.dumps(value) == with_orjson and json_codec.loads(with_orjson) == value


def test_the_standard_library_codec_keeps_orjsons_rules(monkeypatch):
    monkeypatch.setattr(json_codec, "orjson", None)
    assert json_codec.dumps({"lp": -math.inf, "x": [math.nan]}) == b'{"lp":null,"x":[null]}'
    for bad in (b'{"t": NaN}', b"[Infinity]", b"[" * 2000 + b"]" * 2000, b"{"):
        with pytest.raises(json_codec.JSONDecodeError):
            json_codec.loads(bad)
    assert json_codec.loads(b'"[[[[{"') == "[[[[{"  # brackets inside strings do not count as nesting
