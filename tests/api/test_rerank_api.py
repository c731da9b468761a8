"""/v1/rerank and /v1/score through `sluice serve` started with vLLM's Qwen3-Reranker launch line (`--runner
pooling --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
"yes"], "is_original_qwen3_reranker": true}'`) on tests/support/reranker.py's tiny Qwen3, over plain HTTP: scores
equal the model card's formula computed by transformers on the same weights (1e-4), results best first, top_n,
return_documents, the request's instruction, vLLM-style preformatted pairs, score 1:1 / 1:N / N:N, usage, the
shared query prefix hitting the prefix cache, and the refusals (too many documents, none, one past the context,
pairs that do not match, a model that is no reranker, a server on the generate runner).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.support import reranker as R
from tests.support.server import MODEL, Server

pytestmark = pytest.mark.timeout(300)
TOLERANCE = 1e-4
MAX_DOCUMENTS = 6  # --max-embedding-inputs of the server: the cap on a call's documents
CONTEXT = 160


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, smollm2_dir) -> str:
    return R.save_tiny_reranker(tmp_path_factory.mktemp("qwen3-reranker"), str(smollm2_dir))


@pytest.fixture(scope="module")
def server(reranker_dir, tmp_path_factory):
    srv = Server(reranker_dir, tmp_path_factory.mktemp("logs"), *R.LAUNCH, "--num-kv-blocks", "64",
                 "--max-model-len", str(CONTEXT), "--max-num-batched-tokens", "64",
                 "--max-embedding-inputs", str(MAX_DOCUMENTS)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def want(reranker_dir) -> list[float]:
    """transformers' score of each of R.DOCUMENTS against R.QUERY, prompts as the model card builds them."""
    return [R.reference_score(reranker_dir, R.model_card_ids(reranker_dir, R.QUERY, d)) for d in R.DOCUMENTS]


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(srv.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refused(srv, path: str, body: dict, status: int = 400) -> dict:
    code, reply = post(srv, path, body)
    assert code == status, (code, reply)
    assert set(reply) == {"error"} and reply["error"]["message"], reply
    return reply["error"]


def prefix_hits(srv) -> float:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("sluice_prefix_cache_hit_tokens_total{"))


def test_rerank_orders_by_the_model_cards_score(server, reranker_dir, want):
    code, reply = post(server, "/v1/rerank", {"model": MODEL, "query": R.QUERY, "documents": R.DOCUMENTS})
    assert code == 200, reply
    assert reply["id"].startswith("rerank-") and reply["model"] == MODEL
    results = reply["results"]
    assert [r["index"] for r in results] == sorted(range(len(want)), key=lambda i: -want[i])
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) <= TOLERANCE, (r, want)
        assert r["document"] == {"text": R.DOCUMENTS[r["index"]]}
    tokens = sum(len(R.model_card_ids(reranker_dir, R.QUERY, d)) for d in R.DOCUMENTS)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # vLLM's other paths; top_n keeps the best; return_documents false leaves the texts out
    for path in ("/rerank", "/v2/rerank"):
        code, top = post(server, path, {"query": R.QUERY, "documents": R.DOCUMENTS, "top_n": 2,
                                        "return_documents": False})
        assert code == 200, top
        assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
        assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
        assert top["usage"]["total_tokens"] == tokens  # every document is scored, whatever top_n


def test_the_query_prefix_is_computed_once(server):
    before = prefix_hits(server)
    code, reply = post(server, "/v1/rerank", {"query": "Which city is the capital of France?",
                                              "documents": ["Paris.", "Berlin.", "Rome."]})
    assert code == 200, reply
    # the system line, instruction and query fill several 16-token blocks every document's prompt shares
    assert prefix_hits(server) - before >= 2 * 16 * 3


def test_instruction_and_preformatted_pairs(server, reranker_dir):
    mine = "Given a question, find the passage that answers it"
    code, reply = post(server, "/v1/rerank", {"query": R.QUERY, "documents": R.DOCUMENTS[:2], "instruction": mine})
    assert code == 200, reply
    for r in reply["results"]:
        ids = R.model_card_ids(reranker_dir, R.QUERY, R.DOCUMENTS[r["index"]], mine)
        assert abs(r["relevance_score"] - R.reference_score(reranker_dir, ids)) <= TOLERANCE
    # vLLM's Qwen3-Reranker example formats the pair itself: taken as it is, text_1's tokens then text_2's
    text_1 = f"{R.PREFIX}<Instruct>: {mine}\n<Query>: {R.QUERY}\n"
    text_2 = [f"<Document>: {d}{R.SUFFIX}" for d in R.DOCUMENTS[:2]]
    code, reply = post(server, "/v1/score", {"text_1": text_1, "text_2": text_2})
    assert code == 200, reply
    tok = R.tokenizer(reranker_dir)
    for item, doc in zip(reply["data"], text_2, strict=True):
        ids = tok(text_1)["input_ids"] + tok(doc, add_special_tokens=False)["input_ids"]
        assert abs(item["score"] - R.reference_score(reranker_dir, ids)) <= TOLERANCE
    assert refused(server, "/v1/score", {"text_1": text_1, "text_2": text_2, "instruction": mine})["param"] == \
        "instruction"


def test_score_one_to_one_one_to_many_and_pairs(server, reranker_dir, want):
    code, reply = post(server, "/v1/score", {"model": MODEL, "text_1": R.QUERY, "text_2": R.DOCUMENTS})
    assert code == 200, reply
    assert reply["id"].startswith("score-") and reply["object"] == "list" and reply["model"] == MODEL
    assert [d["index"] for d in reply["data"]] == list(range(len(R.DOCUMENTS)))
    assert all(d["object"] == "score" for d in reply["data"])
    for d in reply["data"]:
        assert abs(d["score"] - want[d["index"]]) <= TOLERANCE
    assert reply["usage"]["total_tokens"] == sum(len(R.model_card_ids(reranker_dir, R.QUERY, d))
                                                 for d in R.DOCUMENTS)
    code, one = post(server, "/score", {"text_1": [R.QUERY], "text_2": R.DOCUMENTS[1]})
    assert code == 200 and len(one["data"]) == 1 and abs(one["data"][0]["score"] - want[1]) <= TOLERANCE, one
    queries = ["Explain gravity", R.QUERY, "你好"]
    code, pairs = post(server, "/v1/score", {"text_1": queries, "text_2": R.DOCUMENTS[:3]})
    assert code == 200, pairs
    for d, query, doc in zip(pairs["data"], queries, R.DOCUMENTS[:3], strict=True):
        ids = R.model_card_ids(reranker_dir, query, doc)
        assert abs(d["score"] - R.reference_score(reranker_dir, ids)) <= TOLERANCE
    # newer vLLM's names for them
    code, named = post(server, "/v1/score", {"queries": R.QUERY, "documents": R.DOCUMENTS})
    assert code == 200 and [d["score"] for d in named["data"]] == [d["score"] for d in reply["data"]], named


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": R.QUERY, "documents": ["d"] * (MAX_DOCUMENTS + 1)}, "documents"),
    ("/v1/rerank", {"query": R.QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": R.QUERY, "documents": ["d", 3]}, "documents[1]"),
    ("/v1/rerank", {"query": R.QUERY, "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": R.QUERY, "documents": ["d"], "model": "other"}, "model"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["d"] * (MAX_DOCUMENTS + 1)}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
])
def test_bad_calls_are_a_4xx_naming_the_parameter(server, path, body, param):
    error = refused(server, path, body, 404 if param == "model" else 400)
    assert error["param"] == param, error
    if "items on this server" in error["message"]:
        assert "--max-embedding-inputs" in error["message"]


def test_a_document_past_the_context_is_refused(server):
    long = "Paris is the capital of France. " * 40  # ~280 tokens with the template: past the 160-token context
    for path, body, param in (("/v1/rerank", {"query": R.QUERY, "documents": ["short", long]}, "documents[1]"),
                              ("/v1/score", {"text_1": R.QUERY, "text_2": ["short", long]}, "text_2[1]"),
                              ("/v1/rerank", {"query": long, "documents": ["short"]}, "query"),
                              ("/v1/score", {"text_1": ["a", long], "text_2": ["b", "c"]}, "text_1[1]")):
        error = refused(server, path, body)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    assert server.health()["running"] == 0


def test_a_generate_server_does_not_serve_them(tiny_server):
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"):
        error = refused(tiny_server, path, {"query": "q", "documents": ["d"], "text_1": "q", "text_2": "d"}, 404)
        assert error["code"] == "pooling_runner_disabled" and "--runner pooling" in error["message"], error


def test_a_pooling_server_without_classifier_tokens_says_it_is_no_reranker():
    """The check the routes make, on a model of the pooling runner without classifier_from_token."""
    from sluice.service.api.errors import RequestError
    from sluice.service.api.rerank import prepare_rerank
    from sluice.service.engine.async_engine import ModelInfo

    model = ModelInfo(MODEL, 128, 100, tokenizer=None, runner_type="pooling", classifier=None)
    with pytest.raises(RequestError) as e:
        prepare_rerank(b'{"query": "q", "documents": ["d"]}', model)
    assert (e.value.status, e.value.code, e.value.param) == (400, "model_not_reranker", "model")
    assert "classifier_from_token" in e.value.message
