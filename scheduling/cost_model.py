"""What an engine step costs in wall time, learnt from the steps the engine runs (no constant tuned for one machine).

A step's time is modelled as a sum of non-negative terms, each with a physical reason to be there:

    seconds ≈ a                          fixed cost of a step (scheduling, launch, sampling, detokenizing)
            + a_p · [any prefill]        what a step with prompt tokens pays once more (eager forward, no graph)
            + b · prefill_tokens         matmul rows beyond one per decoding request (prompt chunks, drafts)
            + c · decode_rows            one row per decoding request
            + e · context / 1e3          keys and values each row's attention reads (start + tokens per row)
            + f · attention_pairs / 1e6  query-key pairs of prompt chunks (a long prompt's later chunks cost more)
            + g · constrained_rows       decoding rows under a grammar (their token masks, and the grammar's step)

It is fitted by exponentially weighted least squares, with the constraint that no coefficient is negative (a term
that seems to save time is noise), and with outliers clipped (a step a neighbour stalled counts at most 1.5 times
what was predicted). Steps with and without prompt tokens keep separate statistics, each forgotten
only as new steps of its own kind arrive: a long stretch of mixed steps does not erase what a decode-only step
costs, which is what the time-between-tokens target is made from.
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_FEATURES = 7
FORGET = 0.9  # weight of the past per new observation of the same kind: about the last 10 steps count
RIDGE = 1e-6  # relative to each feature's own scale, so an unobserved term stays at zero
EPS = 1e-12
# A step measured past OUTLIER times (or below 1 / OUTLIER of) the prediction counts as that much, once WARM steps of
# its kind are known: one stall on a shared machine must not move the fit far, yet a lasting change (3x slower)
# is followed within a few dozen steps.
OUTLIER = 1.5
WARM = 8
REFIT_EVERY = 8


@dataclass(slots=True)
class StepShape:
    """What a step computes, in the terms its cost is modelled in."""

    prefill_tokens: int = 0  # tokens beyond one per decode row: prompt chunks (and drafts)
    decode_rows: int = 0
    context_tokens: int = 0  # sum over rows of the context its attention reads: start + tokens
    attention_pairs: int = 0  # sum over prompt chunks of q * (start + (q + 1) / 2)
    constrained_rows: int = 0  # decoding rows under a grammar

    def add_decode(self, start: int, tokens: int = 1, constrained: bool = False) -> None:
        """One decoding request's row (tokens > 1: it verifies drafts; constrained: under a grammar)."""
        self.decode_rows += 1
        self.constrained_rows += constrained
        self.prefill_tokens += tokens - 1
        self.context_tokens += start + tokens

    def add_chunk(self, start: int, tokens: int) -> None:
        """A prompt chunk of `tokens` at position `start`."""
        self.prefill_tokens += tokens
        self.context_tokens += start + tokens
        self.attention_pairs += chunk_pairs(start, tokens)

    def features(self) -> list[float]:
        """The regressors, in the coefficients' order."""
        return [1.0, 1.0 if self.prefill_tokens else 0.0, float(self.prefill_tokens), float(self.decode_rows),
                self.context_tokens / 1e3, self.attention_pairs / 1e6, float(self.constrained_rows)]

    def copy(self) -> StepShape:
        """An independent copy (the planner grows one per grant it tries)."""
        return StepShape(self.prefill_tokens, self.decode_rows, self.context_tokens, self.attention_pairs,
                         self.constrained_rows)


def chunk_pairs(start: int, tokens: int) -> int:
    """Query-key pairs of a causal chunk of `tokens` after `start` computed tokens."""
    return tokens * start + tokens * (tokens + 1) // 2


class _Moments:
    """Exponentially weighted X'X and X'y of one kind of step."""

    __slots__ = ("xx", "xy", "count")

    def __init__(self) -> None:
        self.xx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self.xy = [0.0] * NUM_FEATURES
        self.count = 0

    def add(self, x: list[float], y: float) -> None:
        for i in range(NUM_FEATURES):
            row = self.xx[i]
            for j in range(NUM_FEATURES):
                row[j] = FORGET * row[j] + x[i] * x[j]
            self.xy[i] = FORGET * self.xy[i] + x[i] * y
        self.count += 1


class StepCostModel:
    """Predicts a step's seconds from its StepShape; `observe` refits after every measured step."""

    __slots__ = ("_decode", "_mixed", "_coef", "_decode_coef", "_decode_seen", "_stale", "_decode_stale")

    def __init__(self) -> None:
        self._decode, self._mixed = _Moments(), _Moments()
        self._coef = [0.0] * NUM_FEATURES  # a, a_p, b, c, e, f, g (seconds per unit of each feature)
        # Fitted on decode-only steps alone: what the time-between-tokens target is made from. Mixed steps must not
        # move it (a long prefill would raise its own target through the terms both kinds share).
        self._decode_coef = [0.0] * NUM_FEATURES
        self._decode_seen = [0.0] * NUM_FEATURES  # the largest value of each feature in a decode-only step
        self._stale = self._decode_stale = 0  # observations since the last fit (of each)

    @property
    def observations(self) -> int:
        """Steps observed so far."""
        return self._decode.count + self._mixed.count

    @property
    def knows_prefill(self) -> bool:
        """Whether a step with prompt tokens has been observed (else prefill looks free)."""
        return self._mixed.count > 0

    @property
    def coef(self) -> list[float]:
        """The coefficients fitted to every observation so far."""
        self._refit(force=True)
        return list(self._coef)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Account one measured step (the fit follows within REFIT_EVERY observations of each kind)."""
        if not seconds > 0:
            return
        kind = self._mixed if shape.prefill_tokens else self._decode
        if kind.count >= WARM:  # a step a neighbour stalled counts as at most OUTLIER x the prediction
            predicted = sum(c * x for c, x in zip(self._coef, shape.features(), strict=True))  # no refit here
            seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER) if predicted > 0 else seconds
        features = shape.features()
        kind.add(features, seconds)
        self._stale += 1
        if kind is self._decode:
            self._decode_stale += 1
            self._decode_seen = [max(a, b) for a, b in zip(self._decode_seen, features, strict=True)]
        self._refit()

    def _refit(self, force: bool = False) -> None:
        """Solve again once REFIT_EVERY observations came in (every one while the model is young): a fit is a
        few hundred microseconds of Python, too much for every step of a fast machine."""
        young = self.observations <= 4 * WARM
        if self._stale and (force or young or self._stale >= REFIT_EVERY):
            self._coef, self._stale = _fit(self._decode, self._mixed), 0
        if self._decode_stale and (force or young or self._decode_stale >= REFIT_EVERY):
            self._decode_coef, self._decode_stale = _fit(self._decode), 0

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape (0 before any observation)."""
        self._refit()
        return sum(c * x for c, x in zip(self._coef, shape.features(), strict=True))

    def predict_decode(self, shape: StepShape) -> float:
        """Predicted seconds of the decode-only step of `shape`'s decoding rows, from decode-only steps alone (the
        whole model's, before any was measured). No extrapolation: each feature counts at most as much as in the
        decode-only steps seen (streams whose context grows through a long prefill keep the target they had)."""
        if not self._decode.count:
            return self.predict(shape)
        self._refit()
        features = [min(x, seen) for x, seen in zip(shape.features(), self._decode_seen, strict=True)]
        return sum(c * x for c, x in zip(self._decode_coef, features, strict=True))


def _fit(*moments: _Moments) -> list[float]:
    """Non-negative least squares over the summed moments (Lawson-Hanson, on the normal equations)."""
    g = [[sum(m.xx[i][j] for m in moments) for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
    h = [sum(m.xy[i] for m in moments) for i in range(NUM_FEATURES)]
    for i in range(NUM_FEATURES):
        g[i][i] += RIDGE * g[i][i] + EPS
    x, active = [0.0] * NUM_FEATURES, []
    for _ in range(3 * NUM_FEATURES):
        grad = [h[i] - sum(g[i][j] * x[j] for j in range(NUM_FEATURES)) for i in range(NUM_FEATURES)]
        j = max((i for i in range(NUM_FEATURES) if i not in active), key=lambda i: grad[i], default=None)
        if j is None or grad[j] <= EPS * (1 + abs(h[j])):
            break
        active.append(j)
        while active:
            z = _solve([[g[r][c] for c in active] for r in active], [h[r] for r in active])
            if min(z) > 0:
                for k, i in enumerate(active):
                    x[i] = z[k]
                break
            # Step from x toward z as far as every coefficient stays >= 0; those that reach 0 leave.
            alpha = min(x[i] / (x[i] - z[k]) if x[i] > z[k] else 0.0 for k, i in enumerate(active) if z[k] <= 0)
            for k, i in enumerate(active):
                x[i] += alpha * (z[k] - x[i])
            active = [i for i in active if x[i] > EPS]
            for i in range(NUM_FEATURES):
                if i not in active:
                    x[i] = 0.0
    return x


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small, symmetric positive definite system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        if abs(p) < EPS:
            continue
        for r in range(col + 1, n):
            factor = m[r][col] / p
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        p = m[r][r]
        x[r] = 0.0 if abs(p) < EPS else (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / p
    return x
