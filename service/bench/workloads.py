"""Benchmark workloads: request counts and lengths, shared prefixes, arrival times, and the prompts themselves."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sluice.service.bench.repetitive import edit_prompts

# `sluice bench serve --mixed`'s large request (mixed.py): a prompt list, separate requests, embedding inputs, or a
# prompt list under a small grammar. Here, not in mixed.py, so the CLI's parser names them without importing aiohttp.
LARGE_KINDS = ("prompts", "separate", "embeddings", "grammar")

DATASETS = ("random", "repetitive")

# Short, common words: each is about one token in any English BPE vocabulary, so a prompt of N words is
# roughly N tokens even when the client has no tokenizer to check.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very"
).split()


@dataclass(slots=True)
class Workload:
    """What to send: how many requests, how long, how fast. `input_len` counts the shared prefix too."""

    name: str = "custom"
    num_prompts: int = 64
    input_len: int = 100
    output_len: int = 128
    random_range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # leading tokens identical in every prompt
    max_concurrency: int = 0  # 0: no limit
    request_rate: float = math.inf  # requests/s with Poisson arrivals; inf: all at once
    seed: int = 0
    dataset: str = "random"  # or "repetitive": passages to return with small edits (input_len unused)

    def validate(self) -> None:
        """Raise ValueError on impossible settings."""
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError("random_range_ratio must be in [0, 1)")
        if not 0 <= self.prefix_len < self.input_len * (1 - self.random_range_ratio):
            raise ValueError("prefix_len must be shorter than every prompt")
        if self.max_concurrency < 0 or not self.request_rate > 0:
            raise ValueError("max_concurrency must be >= 0 and request_rate > 0")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}")


def sample_lengths(w: Workload) -> list[tuple[int, int]]:
    """(prompt length, output length) of each request, reproducible from the seed."""
    rng = random.Random(w.seed)

    def draw(n: int) -> int:
        if not w.random_range_ratio:
            return n
        return rng.randint(
            max(1, math.floor(n * (1 - w.random_range_ratio))), math.ceil(n * (1 + w.random_range_ratio))
        )

    return [(draw(w.input_len), draw(w.output_len)) for _ in range(w.num_prompts)]


def token_prompts(w: Workload, vocab_size: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[list[int]]:
    """Prompts of random token ids (special ids excluded), sharing the first `prefix_len` tokens."""
    rng = random.Random(w.seed + 1)
    allowed = [t for t in range(vocab_size) if t not in exclude]
    prefix = [rng.choice(allowed) for _ in range(w.prefix_len)]
    return [prefix + [rng.choice(allowed) for _ in range(n - w.prefix_len)] for n, _ in sample_lengths(w)]


def text_prompts(w: Workload, tokenizer=None) -> list[tuple[str, int, int]]:
    """(prompt text, its token count, output length) per request, for servers that take text.

    With a tokenizer: random token ids decoded to text, re-encoded and trimmed so the count is close to the
    target (the server's own tokenization may still differ by a token or two). Without: random words. The
    repetitive dataset's prompts are fixed passages; without a tokenizer their count is a guess (4 chars a token).
    """
    lengths = sample_lengths(w)
    if w.dataset == "repetitive":
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text) // 4

        return [(text, count(text), m) for text, (_, m) in zip(edit_prompts(w.num_prompts), lengths, strict=True)]
    if tokenizer is None:
        rng = random.Random(w.seed + 1)
        prefix = " ".join(rng.choice(WORDS) for _ in range(w.prefix_len))
        out = []
        for n, m in lengths:
            rest = " ".join(rng.choice(WORDS) for _ in range(n - w.prefix_len))
            out.append(((prefix + " " + rest) if prefix else rest, n, m))
        return out
    ids = token_prompts(w, len(tokenizer), frozenset(tokenizer.all_special_ids))
    prefix_text = tokenizer.decode(ids[0][: w.prefix_len]) if w.prefix_len else ""
    out = []
    for prompt, (n, m) in zip(ids, lengths, strict=True):
        text = prefix_text + tokenizer.decode(prompt[w.prefix_len :])
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) > n:  # decoding merged bytes into different tokens: trim back to the target
            text = tokenizer.decode(encoded[:n])
        out.append((text, len(tokenizer.encode(text, add_special_tokens=False)), m))
    return out


def arrival_offsets(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send time of each request in seconds from the start: all zero for inf, else a Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed + 2)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out
