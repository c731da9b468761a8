"""Embeddings and reranker scores: how the served model pools (resolved once at load) and the per-step pooling of
final hidden states.

An embedding request is a prompt-only request: it runs through the same scheduler and batches as generation
(chunked prefill included) and ends after its last prompt chunk with one vector. Last-token pooling reads one
row of that chunk; mean pooling sums the rows of every chunk (kept here between steps, per request) and divides
by the prompt length at the end; first-token pooling keeps the first chunk's first row. The rows are the final
norm's output, in float32.

A score request (/v1/rerank, /v1/score: `ClassifyParams`) is the same prompt-only request, pooled at its last
token, where the row goes on through the LM head: a decoder reranker (Qwen3-Reranker, served with vLLM's
`--hf-overrides '{"classifier_from_token": ["no", "yes"], ...}'`) scores a prompt by the softmax of the last
position's logits over its classifier tokens, the last token's probability (sigmoid(z_yes - z_no) for two).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import Pooling, PoolingParams

logger = logging.getLogger("sluice.pooling")

# sentence-transformers' 1_Pooling/config.json flags, in the order they are looked at
_ST_MODES = (("pooling_mode_lasttoken", Pooling.LAST), ("pooling_mode_mean_tokens", Pooling.MEAN),
             ("pooling_mode_cls_token", Pooling.CLS))


@dataclass(slots=True, frozen=True)
class EmbeddingSpec:
    """How /v1/embeddings pools this model: mode, normalization and the Matryoshka sizes it allows."""

    mode: Pooling
    normalize: bool
    hidden_size: int
    # Matryoshka sizes `dimensions` may ask for: () any up to hidden_size, None: `dimensions` is refused
    dimensions: tuple[int, ...] | None = None

    def dimensions_error(self, dimensions: int) -> str | None:
        """Why a request's `dimensions` cannot be served (None: it can)."""
        if self.dimensions is None:
            return ("this model does not support 'dimensions' (it is not a Matryoshka model; the server allows it "
                    "with --embedding-dimensions)")
        if not 1 <= dimensions <= self.hidden_size:
            return f"'dimensions' must be between 1 and the model's {self.hidden_size}"
        if self.dimensions and dimensions not in self.dimensions:
            return f"'dimensions' must be one of {', '.join(map(str, self.dimensions))}"
        return None


def resolve_embedding(pooling: str, normalize: bool, dimensions: str, model_config) -> EmbeddingSpec:
    """The model's EmbeddingSpec from the --pooling / --embedding-normalize / --embedding-dimensions knobs; 'auto'
    reads sentence-transformers' modules.json and 1_Pooling/config.json, and the config's Matryoshka fields."""
    directory = Path(getattr(model_config, "_name_or_path", "") or ".")
    text_config = model_config.get_text_config()
    hidden = int(text_config.hidden_size)
    mode = Pooling(pooling) if pooling != "auto" else _sentence_transformers_mode(directory) or Pooling.LAST
    return EmbeddingSpec(mode, normalize, hidden, _dimensions(dimensions, text_config))


def _sentence_transformers_mode(directory: Path) -> Pooling | None:
    """The pooling a sentence-transformers model directory declares (None: it is not one)."""
    modules = directory / "modules.json"
    if not directory.is_dir() or not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith(".Pooling"):
            config = json.loads((directory / module.get("path", "") / "config.json").read_text())
            for flag, mode in _ST_MODES:
                if config.get(flag):
                    logger.info("pooling: %s, from %s", mode.value, directory / module.get("path", ""))
                    return mode
            on = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
            raise ValueError(f"{directory}: sentence-transformers pooling {on} is not supported; pass --pooling "
                             "last, mean or cls")
    return None


def _dimensions(knob: str, text_config) -> tuple[int, ...] | None:
    """--embedding-dimensions: 'auto' (the config's matryoshka_dimensions or is_matryoshka), 'any', 'none', or a
    comma-separated list of sizes."""
    if knob == "auto":
        sizes = getattr(text_config, "matryoshka_dimensions", None)
        if sizes:
            return tuple(int(d) for d in sizes)
        return () if getattr(text_config, "is_matryoshka", False) else None
    if knob == "any":
        return ()
    if knob == "none":
        return None
    try:
        sizes = tuple(int(d) for d in knob.split(","))
    except ValueError:
        raise ValueError(f"--embedding-dimensions {knob!r}: use auto, any, none or sizes like 64,128,256") from None
    if any(d < 1 for d in sizes):
        raise ValueError(f"--embedding-dimensions {knob!r}: sizes must be positive")
    return sizes


@dataclass(slots=True, frozen=True)
class ClassifierSpec:
    """A decoder reranker's scoring (vLLM's `classifier_from_token`): the softmax of the last position's logits
    over `token_ids`, the last one's probability; `qwen3_template`: prompts take Qwen3-Reranker's format
    (`is_original_qwen3_reranker`)."""

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    qwen3_template: bool = False


@dataclass(slots=True, frozen=True)
class ClassifyParams(PoolingParams):
    """A score request: pooled at the last token (so a prefix-cache hit is as good as computing it), and the row
    goes through the LM head; its pooled 'vector' is the one score."""

    mode: Pooling = Pooling.LAST
    normalize: bool = False
    token_ids: tuple[int, ...] = ()


def resolve_runner(runner: str, model_config, tokenizer, vocab_size: int) -> tuple[str, ClassifierSpec | None]:
    """--runner resolved ('generate' or 'pooling') and the reranker's classifier tokens (None: not a reranker), from
    the config after --hf-overrides. ValueError where classifier_from_token cannot work with this tokenizer."""
    tokens = getattr(model_config, "classifier_from_token", None)
    architectures = getattr(model_config, "architectures", None) or []
    if runner == "auto":
        runner = "pooling" if tokens or any(str(a).endswith("ForSequenceClassification") for a in architectures) \
            else "generate"
    if not tokens:
        return runner, None
    if not isinstance(tokens, (list, tuple)) or len(tokens) != 2 or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must name two tokens [negative, positive] (as Qwen3-Reranker's "
                         f'["no", "yes"]), not {tokens!r}')
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token or not 0 <= token_id < vocab_size:
            raise ValueError(f"classifier_from_token {token!r} is not a single token of this model's tokenizer")
        ids.append(int(token_id))
    spec = ClassifierSpec(tuple(tokens), tuple(ids), bool(getattr(model_config, "is_original_qwen3_reranker", False)))
    logger.info("runner: %s; classifier tokens %s (ids %s)%s", runner, list(spec.tokens), list(spec.token_ids),
                ", Qwen3-Reranker's prompt format" if spec.qwen3_template else "")
    return runner, spec


class Pooler:
    """Pools each step's embedding rows; holds the partial sums (mean) and first rows (cls) between chunks."""

    def __init__(self) -> None:
        self.partial: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests that ended (aborted, failed, preempted ones restart from their first chunk)."""
        for rid in request_ids:
            self.partial.pop(rid, None)

    def pool(self, hidden: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor],
             scheduled: list[ScheduledRequest],
             head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """hidden [T, E] (the packed step, before the final `norm`) → the vector of each embedding request whose
        prompt ends in this step, on the host in float32; a score request's (ClassifyParams) is its one score,
        from `head`'s logits."""
        done: dict[str, torch.Tensor] = {}
        scores: list[tuple[str, int, tuple[int, ...]]] = []  # (request, row, classifier tokens)
        row = 0
        for r in scheduled:
            params, n = r.sampling_params.pooling, r.num_tokens
            if isinstance(params, ClassifyParams):
                if r.start_pos + n == r.num_prompt_tokens:
                    scores.append((r.request_id, row + n - 1, params.token_ids))
            elif params is not None:
                last = r.start_pos + n == r.num_prompt_tokens
                vector = self._pool_chunk(r, params.mode, hidden, norm, row, last)
                if last:
                    if params.dimensions is not None:
                        vector = vector[: params.dimensions]
                    done[r.request_id] = torch.nn.functional.normalize(vector, dim=0) if params.normalize else vector
            row += n
        if scores:
            done.update(_scores(hidden, norm, head, scores))
        if not done:
            return done
        vectors = torch.cat(list(done.values())).cpu()  # one copy (and sync) for the step, whatever the sizes
        return dict(zip(done, vectors.split([v.shape[0] for v in done.values()]), strict=True))

    def _pool_chunk(self, r: ScheduledRequest, mode: Pooling, hidden: torch.Tensor,
                    norm: Callable[[torch.Tensor], torch.Tensor], row: int, last: bool) -> torch.Tensor | None:
        """This chunk's part: the vector on the prompt's last chunk, else None (state kept in `partial`)."""
        rid, n = r.request_id, r.num_tokens
        if mode is Pooling.LAST:
            return norm(hidden[row + n - 1 : row + n])[0].float() if last else None
        if r.start_pos == 0:  # a first chunk (also after a recompute preemption): nothing carried over
            self.partial.pop(rid, None)
        elif rid not in self.partial:
            raise RuntimeError(f"request {rid}: pooling state lost before position {r.start_pos}")
        if mode is Pooling.MEAN:
            total = norm(hidden[row : row + n]).float().sum(0)
            if r.start_pos:
                total += self.partial.pop(rid)
            if not last:
                self.partial[rid] = total
                return None
            return total / r.num_prompt_tokens
        first = norm(hidden[row : row + 1])[0].float() if r.start_pos == 0 else self.partial.pop(rid)
        if not last:
            self.partial[rid] = first
            return None
        return first


def _scores(hidden: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor],
            head: Callable[[torch.Tensor], torch.Tensor] | None,
            scores: list[tuple[str, int, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Each score request's score, a 1-vector: the softmax of its last row's logits (one head call for the step's
    rows) over its classifier tokens, the last token's probability."""
    if head is None:
        raise RuntimeError("score requests need the model's LM head")
    rows = torch.tensor([row for _, row, _ in scores], device=hidden.device)
    logits = head(norm(hidden[rows])).float()
    ids = torch.tensor([tokens for _, _, tokens in scores], device=logits.device)
    probabilities = torch.softmax(logits.gather(1, ids), dim=-1)[:, -1:]
    return {rid: p for (rid, _, _), p in zip(scores, probabilities, strict=True)}
