"""/v1/embeddings: from body to engine requests (in the preparation pool) and from vectors to the reply.

Any served model answers it with its pooled final hidden state (vLLM serves a generative model the same way
with its pooling runner): an embedding model (Qwen3-Embedding, a sentence-transformers decoder) gives its
trained vectors, a chat model a usable but untrained one. Each input is one prompt-only engine request, batched
with whatever else runs; how the model pools is resolved once at load (service/executor/pooling.py). A `model`
naming a LoRA adapter gives that adapter's vectors (its deltas apply to the pooled forward as to generation), and
`cache_salt` isolates the prefix cache as on the completion routes: both enter the request's SamplingParams and
so the first block's hash.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from sluice.scheduling.sampling_params import PoolingParams, SamplingParams
from sluice.service.api import json_codec
from sluice.service.api.errors import RequestError, context_length_error
from sluice.service.api.preprocess import check_model, load_body, refuse_if_longer_than_context
from sluice.service.api.protocol import DEFAULT_CAPS, RequestCaps, invalid
from sluice.service.api.protocol_embeddings import EmbeddingRequest
from sluice.service.engine.async_engine import ModelInfo
from sluice.service.engine.outputs import EngineOutput


@dataclass(slots=True)
class PreparedEmbeddings:
    """A validated, tokenized embeddings call: one engine request per input, in input order."""

    batch: list[tuple[str, list[int], SamplingParams]]
    priority: int
    base64: bool
    model: str | None = None  # the requested model name (an adapter's, or the served one); None: not given


def prepare_embeddings(raw: bytes, model: ModelInfo, caps: RequestCaps = DEFAULT_CAPS) -> PreparedEmbeddings:
    """Everything between the body's bytes and `AsyncEngine.add_requests`; `caps`: the server's per-request bounds
    (--max-embedding-inputs)."""
    body = load_body(raw)
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as e:
        raise invalid(e) from None
    lora = check_model(req.model, model)  # 404 for a name not served
    spec = model.embedding
    if spec is None:
        raise RequestError("this server does not serve embeddings", "model")
    inputs = req.input
    inputs = [inputs] if isinstance(inputs, str) or isinstance(inputs[0], int) else inputs
    caps.check_embedding_inputs(len(inputs))
    if req.dimensions is not None and (why := spec.dimensions_error(req.dimensions)) is not None:
        raise RequestError(why, "dimensions")
    keep = _truncation(req.truncate_prompt_tokens, model.max_model_len)
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(spec.mode, spec.normalize, req.dimensions),
                            cache_salt=req.cache_salt, lora_request=lora)
    prefix = "embd-" + uuid.uuid4().hex
    batch = []
    for i, ids in enumerate(_token_ids(inputs, model, req.get("add_special_tokens"), keep is None)):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if not ids:
            raise RequestError(f"'{where}' has no tokens", where)
        if keep is not None:
            ids = ids[-keep:]
        elif len(ids) > model.max_model_len:
            raise context_length_error(model.max_model_len, f"'{where}' has {len(ids)} tokens. Shorten it, or pass "
                                       "truncate_prompt_tokens.", where)
        batch.append((f"{prefix}-{i}", ids, params))
    return PreparedEmbeddings(batch, req.get("priority"), req.get("encoding_format") == "base64", req.model)


def _truncation(truncate: int | None, max_model_len: int) -> int | None:
    """How many last tokens of each input to keep (None: refuse longer inputs)."""
    if truncate is None:
        return None
    if truncate == 0:
        raise RequestError("'truncate_prompt_tokens' must be -1 (the context length) or at least 1",
                           "truncate_prompt_tokens")
    if truncate > max_model_len:
        raise RequestError(f"'truncate_prompt_tokens' must be at most the context length, {max_model_len}",
                           "truncate_prompt_tokens")
    return max_model_len if truncate == -1 else truncate


def _token_ids(inputs: list, model: ModelInfo, special: bool, bound_text: bool) -> list[list[int]]:
    """Each input's token ids: texts through the tokenizer (refused first where their bytes alone prove them longer
    than the context, unless they are to be truncated), ids checked against the vocabulary."""
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    for i, text in texts:
        if bound_text:  # +1: an embedding's prompt may fill the whole context (nothing is generated after it)
            refuse_if_longer_than_context(text, model.tokenizer, model.max_model_len + 1,
                                          "input" if len(inputs) == 1 else f"input[{i}]")
    out = list(inputs)
    if texts:
        encoded = model.tokenizer([t for _, t in texts], add_special_tokens=special)["input_ids"]
        for (i, _), ids in zip(texts, encoded, strict=True):
            out[i] = list(ids)
    for i, ids in enumerate(out):
        if not isinstance(inputs[i], str) and any(t >= model.vocab_size for t in ids):
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            raise RequestError(f"'{where}' holds a token id outside the vocabulary (0..{model.vocab_size - 1})",
                               where)
    return out


def embedding_response(prep: PreparedEmbeddings, outputs: dict[str, EngineOutput], model_name: str) -> bytes:
    """The reply's JSON: one vector per input, in input order (float32 numbers, or their bytes in base64); its
    `model` is the one the request named (an adapter's name), else `model_name`, the served one."""
    data, tokens = [], 0
    for index, (rid, _, _) in enumerate(prep.batch):
        out = outputs[rid]
        vector = out.embedding.numpy()
        embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if prep.base64 else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens += out.num_prompt_tokens
    reply = {"object": "list", "data": data, "model": prep.model or model_name,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return json_codec.dumps(reply)
