"""How far a server's next-token distribution after a whole prompt lies from a reference server's: the first token
comes from the prefill, so this weighs a format's prefill numerics (int8-rounded activations, float tiles) where a
greedy answer only shows its top token. For each prompt, the top-20 log-probabilities of both (`/v1/completions`,
`max_tokens` 1, `logprobs` 20, temperature 0): KL(reference || server) over the reference's top 20, a token the
server leaves out of its own top 20 counted at its 20th log-probability; and whether the top tokens agree.

    python bench/first_token_kl.py --reference http://127.0.0.1:8001 \\
        --server float-prefill=http://127.0.0.1:8002 --server llama.cpp=http://127.0.0.1:8003
"""

from __future__ import annotations

import argparse
import json
import math
import urllib.request

from sluice.service.bench.quant_quality import PROMPTS, TEXT  # `bench quant`'s fixed text and questions

HISTORY = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
           "Constantinople. Its armies, roads and laws shaped Europe. ") * 6
TOP = 20


def prompts() -> list[str]:
    """Prefixes of two texts, 20 words and more (prompts of ~25 to ~300 tokens: every prefill path), and questions."""
    words, history = TEXT.split(), HISTORY.split()
    return ([" ".join(words[:n]) for n in range(20, len(words), 14)]
            + [" ".join(history[:n]) for n in range(25, len(history), 25)] + list(PROMPTS))


def top_logprobs(url: str, prompt: str) -> dict[str, float]:
    """The first token's top log-probabilities, by token text (OpenAI's shape, or llama.cpp's `content` list)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "logprobs": TOP, "n_probs": TOP, "temperature": 0}
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        logprobs = json.load(response)["choices"][0]["logprobs"]
    if "content" in logprobs:  # llama.cpp's server
        return {t["token"]: t["logprob"] for t in logprobs["content"][0]["top_logprobs"]}
    return logprobs["top_logprobs"][0]


def kl(reference: dict[str, float], other: dict[str, float]) -> float:
    """KL(reference || other) over the reference's listed tokens (nats)."""
    floor = min(other.values())
    return sum(math.exp(lp) * (lp - other.get(token, floor)) for token, lp in reference.items())


def main() -> None:
    """Print each server's mean, median and largest KL and its top-1 agreement with the reference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="URL of the reference server (float weights)")
    parser.add_argument("--server", action="append", required=True, help="NAME=URL of a server to compare")
    args = parser.parse_args()
    texts = prompts()
    reference = [top_logprobs(args.reference, p) for p in texts]
    print(f"{len(texts)} prompts; KL(reference || server) in nats over the reference's top {TOP}")
    for spec in args.server:
        name, url = spec.split("=", 1)
        got = [top_logprobs(url, p) for p in texts]
        kls = sorted(kl(r, g) for r, g in zip(reference, got, strict=True))
        agree = sum(max(r, key=r.get) == max(g, key=g.get) for r, g in zip(reference, got, strict=True))
        print(f"{name}: mean {sum(kls) / len(kls):.4f}, median {kls[len(kls) // 2]:.4f}, max {kls[-1]:.4f}, "
              f"top-1 agrees {agree}/{len(texts)}")


if __name__ == "__main__":
    main()
