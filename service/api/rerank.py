"""/v1/rerank and /v1/score: from body to engine requests (in the preparation pool) and from scores to the reply.

A decoder reranker (Qwen3-Reranker) is a causal LM that answers "yes" or "no": served with vLLM's launch line
(`--runner pooling --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": true}'`) Sluice runs its own forward and scores each (query, document)
pair by the model card's formula: the prompt in Qwen3-Reranker's format, and softmax([z_no, z_yes])[yes] of the
last position's logits (service/executor/pooling.py). Each pair is one prompt-only engine request, all of a call in
one add_requests (one flow); the query's prompt prefix is the same for every document, so the prefix cache
computes it once.

The prompt is the model card's: its system line, `<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>:
{document}` in the user turn, and the assistant turn opened with an empty think block; the request's `instruction`
replaces the default one. A query that is already a formatted prompt (it starts with `<|im_start|>`, as vLLM's
Qwen3-Reranker example formats text_1 and text_2 itself) is taken as it is: the pair's tokens are text_1's then
text_2's, as vLLM builds them. A reranker without is_original_qwen3_reranker gets that plain pair too.

A server on the generate runner does not serve these routes (404 `pooling_runner_disabled`: vLLM registers none,
so a client sees the same status, here naming the rule); one on the pooling runner whose model has no classifier
tokens answers 400 `model_not_reranker`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.api import json_codec
from sluice.service.api.errors import ApiErrorCode, RequestError, context_length_error
from sluice.service.api.preprocess import check_model, load_body, refuse_if_longer_than_context
from sluice.service.api.protocol import DEFAULT_CAPS, RequestCaps, invalid
from sluice.service.api.protocol_rerank import RerankRequest, ScoreRequest
from sluice.service.engine.async_engine import ModelInfo
from sluice.service.engine.outputs import EngineOutput
from sluice.service.executor.pooling import ClassifierSpec, ClassifyParams

# Qwen3-Reranker's prompt, as its model card builds it
QWEN3_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
FORMATTED = "<|im_start|>"  # a query that starts so is a formatted prompt already


def qwen3_reranker_ids(tokenizer, instruction: str, query: str, document: str) -> list[int]:
    """The model card's prompt: prefix tokens, then `<Instruct>: ...\\n<Query>: ...\\n<Document>: ...` tokenized,
    then suffix tokens."""
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return [*_ids(tokenizer, QWEN3_PREFIX), *_ids(tokenizer, body), *_ids(tokenizer, QWEN3_SUFFIX)]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(slots=True)
class PreparedScores:
    """A validated, tokenized rerank or score call: one engine request per (query, document) pair, in order."""

    batch: list[tuple[str, list[int], SamplingParams]]
    priority: int
    prefix: str  # the reply's id
    model: str | None  # the requested model name (an adapter's, or the served one); None: not given
    documents: list[str] | None = None  # rerank: the documents (None: a score call)
    top_n: int = 0
    return_documents: bool = True
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, outputs: dict[str, EngineOutput], model_name: str) -> bytes:
        """The reply's JSON: rerank's results best first (top_n of them), or score's data in pair order."""
        scores = [float(outputs[rid].embedding[0]) for rid, _, _ in self.batch]
        tokens = sum(outputs[rid].num_prompt_tokens for rid, _, _ in self.batch)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        model = self.model or model_name
        if self.documents is None:
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            return json_codec.dumps({"id": self.prefix, "object": "list", "created": self.created, "model": model,
                                     "data": data, "usage": usage})
        order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: equal scores keep document order
        results = []
        for i in order[: self.top_n or None]:
            result = {"index": i, "relevance_score": scores[i]}
            if self.return_documents:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        return json_codec.dumps({"id": self.prefix, "model": model, "results": results, "usage": usage})


def _validated(raw: bytes, model: ModelInfo, request_model, route: str):
    """(classifier spec, validated body, LoRA adapter or None) of a rerank or score call."""
    spec = _classifier(model, route)
    try:
        req = request_model.model_validate(load_body(raw))
    except ValidationError as e:
        raise invalid(e) from None
    return spec, req, check_model(req.model, model)


def prepare_rerank(raw: bytes, model: ModelInfo, caps: RequestCaps = DEFAULT_CAPS) -> PreparedScores:
    """Everything between a /v1/rerank body's bytes and `AsyncEngine.add_requests`."""
    spec, req, lora = _validated(raw, model, RerankRequest, "/v1/rerank")
    _check_count(len(req.documents), "documents", caps)
    prefix = "rerank-" + uuid.uuid4().hex
    pairs = [(req.query, "query", doc, f"documents[{i}]") for i, doc in enumerate(req.documents)]
    batch = _batch(pairs, req, spec, model, lora, prefix)
    return PreparedScores(batch, req.get("priority"), prefix, req.model, req.documents, req.get("top_n"),
                          req.get("return_documents"))


def prepare_score(raw: bytes, model: ModelInfo, caps: RequestCaps = DEFAULT_CAPS) -> PreparedScores:
    """Everything between a /v1/score body's bytes and `AsyncEngine.add_requests`: text_1 against text_2, 1:1,
    1:N or N:N."""
    spec, req, lora = _validated(raw, model, ScoreRequest, "/v1/score")
    # vLLM's text_1 / text_2, or newer vLLM's queries / documents
    first, name_1 = (req.queries, "queries") if req.text_1 is None and req.queries is not None \
        else (req.text_1, "text_1")
    second, name_2 = (req.documents, "documents") if req.text_2 is None and req.documents is not None \
        else (req.text_2, "text_2")
    for value, name in ((first, name_1), (second, name_2)):
        if value is None:
            raise RequestError(f"'{name}' is required", name)
    texts_1 = [first] if isinstance(first, str) else first
    texts_2 = [second] if isinstance(second, str) else second
    if len(texts_1) != 1 and len(texts_1) != len(texts_2):
        raise RequestError(f"'{name_1}' and '{name_2}' must pair 1:1, 1:N or N:N; got {len(texts_1)} and "
                           f"{len(texts_2)} texts", name_1)
    _check_count(len(texts_2), name_2, caps)

    def where(name: str, texts: list[str] | str, i: int) -> str:
        return name if isinstance(texts, str) else f"{name}[{i}]"

    pairs = [(texts_1[i if len(texts_1) > 1 else 0], where(name_1, first, i if len(texts_1) > 1 else 0), doc,
              where(name_2, second, i)) for i, doc in enumerate(texts_2)]
    prefix = "score-" + uuid.uuid4().hex
    return PreparedScores(_batch(pairs, req, spec, model, lora, prefix), req.get("priority"), prefix, req.model)


def _classifier(model: ModelInfo, route: str) -> ClassifierSpec:
    """The served reranker's classifier tokens; 404 on the generate runner, 400 for a model that is no reranker."""
    if model.runner_type != "pooling":
        raise RequestError(f"this server does not serve {route}: it runs the generate runner (a reranker is served "
                           "with --runner pooling and --hf-overrides naming its classifier_from_token)",
                           code=ApiErrorCode.POOLING_RUNNER_DISABLED)
    if model.classifier is None:
        raise RequestError(f"the served model is not a reranker: {route} needs its classifier tokens, e.g. "
                           '--hf-overrides \'{"architectures": ["Qwen3ForSequenceClassification"], '
                           '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\' for '
                           "Qwen3-Reranker", "model", ApiErrorCode.MODEL_NOT_RERANKER)
    return model.classifier


def _check_count(count: int, param: str, caps: RequestCaps) -> None:
    """The pairs of one call, bounded as /v1/embeddings' inputs are (each is an engine request)."""
    cap, flag = caps.max_embedding_inputs, "--max-embedding-inputs"
    if cap > caps.max_queued:
        cap, flag = caps.max_queued, "--max-queued-requests"
    if count > cap:
        raise RequestError(f"'{param}' may hold at most {cap} items on this server ({flag}), got {count}", param)


def _batch(pairs: list[tuple[str, str, str, str]], req, spec: ClassifierSpec, model: ModelInfo, lora,
           prefix: str) -> list[tuple[str, list[int], SamplingParams]]:
    """One engine request per (query, its param, document, its param): each prompt tokenized and bounded by the
    context, which a prompt-only request may fill."""
    tokenizer, limit, instruction = model.tokenizer, model.max_model_len, req.instruction
    queries = list(dict.fromkeys((q, qp) for q, qp, _, _ in pairs))  # each distinct query and its param, in order
    templated = {q: spec.qwen3_template and not q.startswith(FORMATTED) for q, _ in queries}
    if instruction is not None and not all(templated.values()):
        raise RequestError("'instruction' applies to Qwen3-Reranker's prompt format only (this query is a formatted "
                           "prompt already)" if spec.qwen3_template else
                           "'instruction' applies to Qwen3-Reranker's prompt format only (this reranker's config "
                           "has no is_original_qwen3_reranker)", "instruction")
    # text that cannot fit the context whatever its tokens: refused before anything is tokenized
    texts = [(instruction, "instruction")] if instruction is not None else []
    for text, param in [*texts, *queries, *((doc, param) for _, _, doc, param in pairs)]:
        refuse_if_longer_than_context(text, tokenizer, limit + 1, param)

    def prompt(query: str, doc: str) -> list[int]:
        if templated[query]:
            return qwen3_reranker_ids(tokenizer, instruction or DEFAULT_INSTRUCTION, query, doc)
        return list(tokenizer(text=query, text_pair=doc)["input_ids"])  # text_1's tokens then text_2's, as vLLM's

    for query, param in queries:  # a query too long for any document is the query's fault
        _bound(len(prompt(query, "")), limit, param, "with an empty document")
    params = SamplingParams(max_tokens=1, pooling=ClassifyParams(token_ids=spec.token_ids),
                            cache_salt=req.cache_salt, lora_request=lora)
    batch = []
    for i, (query, _, doc, param) in enumerate(pairs):
        ids = prompt(query, doc)
        if not ids:
            raise RequestError(f"'{param}' makes a prompt with no tokens", param)
        _bound(len(ids), limit, param, "with the query and the reranker's template")
        batch.append((f"{prefix}-{i}", ids, params))
    return batch


def _bound(tokens: int, limit: int, param: str, how: str) -> None:
    """400 context_length_exceeded naming `param` for a prompt past the context (which a score prompt may fill)."""
    if tokens > limit:
        raise context_length_error(limit, f"'{param}' makes a prompt of {tokens} tokens ({how}). Shorten it.", param)
