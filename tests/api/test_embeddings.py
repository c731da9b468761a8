"""/v1/embeddings: pooled vectors equal transformers' for the same tiny random Qwen3 (last, mean and first-token
pooling, prompts spanning several prefill chunks, prefix-cache hits), embedding and generation rows sharing a
batch, and the endpoint through `sluice serve` with the real `openai` client.

Tolerance of the parity checks, against transformers' AutoModel last_hidden_state -> pooling -> L2 normalize, all
in float32: cosine similarity >= 0.9999 and max abs difference <= 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice.scheduling.sampling_params import Pooling, PoolingParams, SamplingParams
from sluice.service.executor.pooling import resolve_embedding
from tests.support import tiny as _tiny

COSINE, MAX_ABS = 0.9999, 1e-4
TEXTS = [
    "The capital of France is Paris. Hello world, how are you today? I am fine, thank you. café naïve résumé 😀",
    "Streaming tokens over server-sent events, one chunk at a time, until the stop string.",
    "你好世界 你好 世界",
    "Hello",
]


def save_tiny_qwen3(path: Path, pooling: str | None = None, **config_extra) -> str:
    """A random tiny Qwen3 decoder saved as embedding models are (the bare Qwen3Model, no head), with the test
    tokenizer; `pooling` adds sentence-transformers' modules.json and 1_Pooling/config.json."""
    import transformers

    tok = _tiny.tokenizer()
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=True, **config_extra)
    torch.manual_seed(7)
    transformers.Qwen3Model(config).save_pretrained(path)
    tok.save_pretrained(path)
    if pooling is not None:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "lasttoken"}))
    return str(path)


def reference(model_dir: str, ids: list[int], mode: Pooling, dimensions: int | None = None) -> torch.Tensor:
    """transformers' vector: AutoModel's last_hidden_state, pooled, cut, L2-normalized, in float32."""
    with torch.no_grad():
        hidden = _reference_model(model_dir)(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {Pooling.LAST: hidden[-1], Pooling.MEAN: hidden.mean(0), Pooling.CLS: hidden[0]}[mode]
    return torch.nn.functional.normalize(vector[:dimensions] if dimensions else vector, dim=0)


_REFERENCES: dict[str, object] = {}


def _reference_model(model_dir: str):
    from transformers import AutoModel

    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _REFERENCES[model_dir]


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    diff = (got - want).abs().max().item()
    assert cosine >= COSINE and diff <= MAX_ABS, f"cosine {cosine}, max abs diff {diff}"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-embed"), is_matryoshka=True)


@pytest.fixture(scope="module")
def qwen3_mean_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-embed-mean"), pooling="mean")


def _engine(model_dir: str, pooling: str = "auto", num_kv_blocks: int = 64, **scheduler):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model, config.model.device, config.model.dtype = model_dir, "cpu", "float32"
    config.model.pooling = pooling
    config.cache.num_kv_blocks, config.cache.block_size = num_kv_blocks, 16
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return LLMEngine(config)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, int, int]:
    """Run requests added together to completion: their final outputs, how many steps mixed embedding and
    generation rows, and how many preemptions there were."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done, tokens, mixed, preempted = {}, {}, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        kinds = {r.sampling_params.pooling is None for r in engine.scheduler.running}
        kinds |= {o.embedding is None for o in outputs}
        mixed += len(kinds) == 2
        preempted += engine.last_stats.num_preemptions_recompute
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
    for rid, out in done.items():
        out.token_ids = tokens[rid]
    return done, mixed, preempted


# ---- parity with transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(Pooling))
def test_vectors_match_transformers_across_chunks_and_cache_hits(qwen3_dir, mode):
    # A 16-token budget: the longer prompts span several prefill chunks (mean sums across them); the second
    # round finds the prompts' blocks in the prefix cache (mean and first-token pooling must not skip them).
    engine = _engine(qwen3_dir, max_num_batched_tokens=16)
    tok = _tiny.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > 32
    for round_ in range(2):
        params = SamplingParams(pooling=PoolingParams(mode))
        done, _, _ = _run(engine, {f"{round_}-{i}": (ids, params) for i, ids in enumerate(prompts)})
        for i, ids in enumerate(prompts):
            out = done[f"{round_}-{i}"]
            assert out.finish_reason == "stop" and out.token_ids == [] and out.num_prompt_tokens == len(ids)
            assert_close(out.embedding, reference(qwen3_dir, ids, mode))
    assert engine.kv_stats()["free_blocks"] == engine.kv_stats()["total_blocks"]


def test_dimensions_and_no_normalize(qwen3_dir):
    engine = _engine(qwen3_dir)
    ids = _tiny.tokenizer().encode(TEXTS[0])
    done, _, _ = _run(engine, {"cut": (ids, SamplingParams(pooling=PoolingParams(Pooling.LAST, dimensions=16))),
                            "raw": (ids, SamplingParams(pooling=PoolingParams(Pooling.LAST, normalize=False)))})
    assert_close(done["cut"].embedding, reference(qwen3_dir, ids, Pooling.LAST, dimensions=16))
    with torch.no_grad():
        raw = _reference_model(qwen3_dir)(torch.tensor([ids])).last_hidden_state[0, -1]
    assert (done["raw"].embedding - raw).abs().max().item() <= MAX_ABS


def test_embedding_and_generation_rows_share_batches(qwen3_mean_dir):
    engine = _engine(qwen3_mean_dir, max_num_batched_tokens=24)
    assert engine.embedding.mode is Pooling.MEAN  # read from 1_Pooling/config.json
    tok = _tiny.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone, _, _ = _run(engine, {f"g{i}": (ids, greedy) for i, ids in enumerate(prompts)})
    embed = SamplingParams(pooling=PoolingParams(Pooling.MEAN))
    requests = {}
    for i, ids in enumerate(prompts):  # interleaved: both kinds in the waiting queue and in the same steps
        requests[f"m{i}"], requests[f"e{i}"] = (ids, greedy), (ids, embed)
    done, mixed, _ = _run(engine, requests)
    assert mixed >= 2
    for i, ids in enumerate(prompts):
        assert done[f"m{i}"].token_ids == alone[f"g{i}"].token_ids
        assert done[f"m{i}"].embedding is None
        assert_close(done[f"e{i}"].embedding, reference(qwen3_mean_dir, ids, Pooling.MEAN))


def test_mean_pooling_survives_recompute_preemption(qwen3_mean_dir):
    # 6 blocks of 16 tokens and an 8-token budget: long generations preempt the embedding requests mid-prompt;
    # each restarts from its first chunk, and its vector is still the whole prompt's mean.
    engine = _engine(qwen3_mean_dir, num_kv_blocks=6, max_num_batched_tokens=8)
    tok = _tiny.tokenizer()
    ids = tok.encode(TEXTS[0])
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    embed = SamplingParams(pooling=PoolingParams(Pooling.MEAN))
    done, _, preempted = _run(engine, {"g0": (ids[:20], greedy), "g1": (ids[:10], greedy), "e0": (ids, embed)})
    assert preempted >= 1
    assert_close(done["e0"].embedding, reference(qwen3_mean_dir, ids, Pooling.MEAN))


# ---- how the pooling is resolved --------------------------------------------------------------------------------

def test_pooling_is_read_from_sentence_transformers_files(qwen3_dir, tmp_path):
    from transformers import AutoConfig

    def spec(directory, pooling="auto", dimensions="auto"):
        return resolve_embedding(pooling, True, dimensions, AutoConfig.from_pretrained(directory))

    assert spec(qwen3_dir).mode is Pooling.LAST and spec(qwen3_dir).dimensions == ()  # is_matryoshka
    for st_mode, mode in [("mean", Pooling.MEAN), ("cls", Pooling.CLS), ("lasttoken", Pooling.LAST)]:
        directory = save_tiny_qwen3(tmp_path / st_mode, pooling=st_mode)
        assert spec(directory).mode is mode
        assert spec(directory, pooling="last").mode is Pooling.LAST  # the knob wins
        assert spec(directory).dimensions is None
        assert spec(directory, dimensions="32,64").dimensions == (32, 64)
        assert "one of 32, 64" in spec(directory, dimensions="32,64").dimensions_error(16)
    cfg = json.loads((tmp_path / "mean" / "1_Pooling" / "config.json").read_text())
    cfg.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (tmp_path / "mean" / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        spec(str(tmp_path / "mean"))
    with pytest.raises(ValueError, match="embedding-dimensions"):
        spec(qwen3_dir, dimensions="big")


# ---- through `sluice serve`, with the openai client ---------------------------------------------------------------

@pytest.fixture(scope="module")
def embed_server(qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 (last-token pooling, Matryoshka) with a 16-token prefill budget and a 64-token context."""
    from tests.support.server import Server

    srv = Server(qwen3_dir, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64", "--max-model-len", "64",
                 "--max-num-batched-tokens", "16").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(embed_server):
    from openai import OpenAI

    return OpenAI(base_url=embed_server.url + "/v1", api_key="none", max_retries=0)


def test_openai_client_float_base64_batch_and_token_ids(client, qwen3_dir):
    from tests.support.server import MODEL

    tok = _tiny.tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    # Without encoding_format the client asks for base64 and decodes it itself; "float" gets JSON numbers.
    for fmt in ({}, {"encoding_format": "float"}):
        reply = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)
        assert [d.index for d in reply.data] == list(range(len(TEXTS))) and reply.model == MODEL
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
        for d, want in zip(reply.data, ids, strict=True):
            assert_close(d.embedding, reference(qwen3_dir, want, Pooling.LAST))
    one = client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert_close(one.data[0].embedding, reference(qwen3_dir, ids[1], Pooling.LAST))
    by_ids = client.embeddings.create(model=MODEL, input=ids[2])
    assert_close(by_ids.data[0].embedding, reference(qwen3_dir, ids[2], Pooling.LAST))
    batch = client.embeddings.create(model=MODEL, input=[ids[0], ids[3]])
    assert_close(batch.data[1].embedding, reference(qwen3_dir, ids[3], Pooling.LAST))
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)
    assert_close(cut.data[0].embedding, reference(qwen3_dir, ids[0], Pooling.LAST, dimensions=8))


def test_base64_is_little_endian_float32(embed_server):
    import base64
    import urllib.request

    import numpy as np

    body = json.dumps({"input": "Hello", "encoding_format": "base64"}).encode()
    request = urllib.request.Request(embed_server.url + "/v1/embeddings", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        reply = json.loads(r.read())
    vector = np.frombuffer(base64.b64decode(reply["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (64,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", 3]}, "input[1]"),
    ({"input": "Hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hello", "dimensions": 0}, "dimensions"),
    ({"input": "Hello", "dimensions": 65}, "dimensions"),
    ({"input": [[1, 2], [10**6]]}, "input[1]"),
    ({"input": ["Hello", "Hello " * 80]}, "input[1]"),
    ({"input": "Hello", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
    ({"input": "Hello", "model": "other"}, "model"),
])
def test_bad_input_is_a_4xx_naming_the_parameter(client, body, param):
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        client.post("/embeddings", body=body, cast_to=object)
    assert 400 <= info.value.status_code < 500
    assert info.value.body["param"] == param, info.value.body


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, qwen3_dir):
    from tests.support.server import MODEL

    ids = _tiny.tokenizer().encode("Hello " * 80)
    assert len(ids) > 64
    reply = client.embeddings.create(model=MODEL, input=ids, extra_body={"truncate_prompt_tokens": 20})
    assert reply.usage.prompt_tokens == 20
    assert_close(reply.data[0].embedding, reference(qwen3_dir, ids[-20:], Pooling.LAST))


def test_embeddings_and_chat_together_through_the_server(client, embed_server, qwen3_dir):
    import asyncio

    from openai import AsyncOpenAI

    from tests.support.server import MODEL, wait_idle

    messages = [{"role": "user", "content": TEXTS[0]}]

    async def main():
        # Closed in the loop that opened it: a client left to the garbage collector closes its connections on
        # whatever loop runs then, a later test's.
        async with AsyncOpenAI(base_url=embed_server.url + "/v1", api_key="none", max_retries=0) as aclient:

            async def chat():
                reply = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                              temperature=0)
                return reply.choices[0].message.content

            async def embed(i):
                return (await aclient.embeddings.create(model=MODEL, input=TEXTS[i % 3])).data[0].embedding

            alone = await chat()
            together = await asyncio.gather(chat(), *(embed(i) for i in range(6)), chat())
        await wait_idle(embed_server)
        return alone, together

    alone, together = asyncio.run(main())
    assert together[0] == together[-1] == alone
    tok = _tiny.tokenizer()
    for i, vector in enumerate(together[1:-1]):
        assert_close(vector, reference(qwen3_dir, tok.encode(TEXTS[i % 3]), Pooling.LAST))


def test_mean_pooling_server_refuses_dimensions(qwen3_mean_dir, tmp_path):
    import openai
    from openai import OpenAI

    from tests.support.server import MODEL, Server

    srv = Server(qwen3_mean_dir, tmp_path, "--num-kv-blocks", "32").wait_ready()
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model=MODEL, input=TEXTS[:2])
        tok = _tiny.tokenizer()
        for d, text in zip(reply.data, TEXTS, strict=False):
            assert_close(d.embedding, reference(qwen3_mean_dir, tok.encode(text), Pooling.MEAN))
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, input="Hello", dimensions=8)
        assert info.value.body["param"] == "dimensions" and "Matryoshka" in info.value.body["message"]
    finally:
        srv.stop()


# ---- `model` naming a LoRA adapter, `cache_salt`, and the per-request caps, through `sluice serve` ----------------

CAP_FLAGS = ("--max-n", "2", "--max-prompts-per-request", "4", "--max-embedding-inputs", "3")


@pytest.fixture(scope="module")
def lora_server(model_dir, tmp_path_factory):
    """The tiny Llama (last-token pooling) in float32 with one adapter given at start-up, and small caps."""
    from tests.support.lora import make_adapter
    from tests.support.server import Server

    adapter = make_adapter(model_dir, str(tmp_path_factory.mktemp("adapter") / "a"), seed=1)
    srv = Server(model_dir, tmp_path_factory.mktemp("logs"), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--lora-modules", f"a={adapter}", *CAP_FLAGS).wait_ready()
    yield srv, adapter
    assert srv.stop() == 0, srv.log()[-3000:]


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _prefix_hits(srv) -> float:
    import urllib.request

    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("sluice_prefix_cache_hit_tokens_total{"))


def _merged_last_hidden(model_dir: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """transformers (+ peft, the adapter merged): the last token's final hidden state, L2-normalized."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0)


def test_an_adapters_name_gives_the_adapters_vectors(lora_server, model_dir):
    from tests.support.server import MODEL

    srv, adapter = lora_server
    ids = _tiny.tokenizer().encode(TEXTS[0])
    status, base = _post(srv, "/v1/embeddings", {"model": MODEL, "input": ids})
    assert status == 200 and base["model"] == MODEL
    status, tuned = _post(srv, "/v1/embeddings", {"model": "a", "input": [ids, ids[:9]]})
    assert status == 200 and tuned["model"] == "a", tuned  # the reply names what was asked for
    assert_close(base["data"][0]["embedding"], _merged_last_hidden(model_dir, None, ids))
    assert_close(tuned["data"][0]["embedding"], _merged_last_hidden(model_dir, adapter, ids))
    assert_close(tuned["data"][1]["embedding"], _merged_last_hidden(model_dir, adapter, ids[:9]))
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(base["data"][0]["embedding"]),
                                                   torch.tensor(tuned["data"][0]["embedding"]), dim=0).item()
    assert cosine < 0.99, cosine  # not the base model's vector
    status, err = _post(srv, "/v1/embeddings", {"model": "b", "input": ids})
    assert status == 404 and err["error"]["param"] == "model"


def test_cache_salt_isolates_embeddings_prefixes(lora_server, model_dir):
    from tests.support.server import MODEL

    srv, adapter = lora_server
    ids = _tiny.tokenizer().encode(TEXTS[1] + " " + TEXTS[0])
    assert len(ids) >= 48  # several full blocks of 16
    want = _merged_last_hidden(model_dir, None, ids)

    def embed(model=MODEL, **extra) -> float:
        """The vector checked; the prefix-cache hits the call added."""
        before = _prefix_hits(srv)
        status, reply = _post(srv, "/v1/embeddings", {"model": model, "input": ids, **extra})
        assert status == 200, reply
        if model == MODEL:
            assert_close(reply["data"][0]["embedding"], want)
        return _prefix_hits(srv) - before

    assert embed(cache_salt="tenant-1") == 0  # the first time: nothing cached
    assert embed(cache_salt="tenant-2") == 0  # another salt finds none of tenant-1's blocks
    assert embed() == 0  # nor does an unsalted request
    assert embed(model="a", cache_salt="tenant-1") == 0  # nor the adapter with the same salt
    assert embed(cache_salt="tenant-1") >= 32  # the same salt does
    for bad in ("", "x" * 257, 5):
        status, err = _post(srv, "/v1/embeddings", {"input": ids, "cache_salt": bad})
        assert status == 400 and err["error"]["param"] == "cache_salt", err


@pytest.mark.parametrize("path, body, param, flag", [
    ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}, "input", "--max-embedding-inputs"),
    ("/v1/embeddings", {"input": [[5], [6], [7], [8]]}, "input", "--max-embedding-inputs"),
    ("/v1/completions", {"prompt": "a", "n": 3}, "n", "--max-n"),
    ("/v1/completions", {"prompt": ["a"] * 5}, "prompt", "--max-prompts-per-request"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 2}, "n", "--max-prompts-per-request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 3}, "n", "--max-n"),
])
def test_fan_out_past_a_cap_is_a_400_naming_the_parameter(lora_server, path, body, param, flag):
    srv, _ = lora_server
    status, err = _post(srv, path, {**body, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == param and flag in err["error"]["message"], err


def test_fan_out_up_to_the_caps_is_served(lora_server):
    srv, _ = lora_server
    status, reply = _post(srv, "/v1/embeddings", {"input": ["a", "b", "c"]})
    assert status == 200 and len(reply["data"]) == 3
    status, reply = _post(srv, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert status == 200 and len(reply["choices"]) == 4, reply
