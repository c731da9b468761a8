"""Embeddings: how the served model pools (resolved once at load) and the per-step pooling of final hidden states.

An embedding request is a prompt-only request: it runs through the same scheduler and batches as generation
(chunked prefill included) and ends after its last prompt chunk with one vector. Last-token pooling reads one
row of that chunk; mean pooling sums the rows of every chunk (kept here between steps, per request) and divides
by the prompt length at the end; first-token pooling keeps the first chunk's first row. The rows are the final
norm's output, in float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import Pooling

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


class Pooler:
    """Pools each step's embedding rows; holds the partial sums (mean) and first rows (cls) between chunks."""

    def __init__(self) -> None:
        self.partial: dict[str, torch.Tensor] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of requests that ended (aborted, failed, preempted ones restart from their first chunk)."""
        for rid in request_ids:
            self.partial.pop(rid, None)

    def pool(self, hidden: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor],
             scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """hidden [T, E] (the packed step, before the final `norm`) → the vector of each embedding request whose
        prompt ends in this step, on the host in float32."""
        done: dict[str, torch.Tensor] = {}
        row = 0
        for r in scheduled:
            params, n = r.sampling_params.pooling, r.num_tokens
            if params is not None:
                last = r.start_pos + n == r.num_prompt_tokens
                vector = self._pool_chunk(r, params.mode, hidden, norm, row, last)
                if last:
                    if params.dimensions is not None:
                        vector = vector[: params.dimensions]
                    done[r.request_id] = torch.nn.functional.normalize(vector, dim=0) if params.normalize else vector
            row += n
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
