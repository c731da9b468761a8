"""What the integer kernels (csrc/int4_linear.cpp, gguf_linear.cpp) do to their activations, in plain torch: the
references of the tests that compare a quantized engine with a float model computing the same arithmetic."""

from __future__ import annotations

import torch
from torch import nn


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernels see it: rounded to int8 per 32 inputs with scale max|x| / 127 (half to even)."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * torch.where(amax > 0, 127 / amax, 0.0))
    return (q * (amax / 127)).reshape(x.shape)


def k_quant_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """What q4_k_linear or q5_k_linear computes on Q4_K or Q5_K rows, in float64: the int8-rounded activations
    times d * sc * q, plus each group's minimum (-dmin * m) times the float sum of its inputs."""
    from sluice.service.executor.layers.gguf_blocks import k4_scales
    from sluice.service.executor.layers.quant_types import BY_NAME, dequantize

    b = blocks.reshape(-1, BY_NAME[qtype].block_bytes)
    dmin = b[:, 2:4].contiguous().view(torch.float16).double()
    m = k4_scales(b[:, 4:16])[1].double()  # the 6-bit minimums
    minimum = (-dmin * m).reshape(blocks.shape[0], k // 32)  # [N, G]
    codes_part = dequantize(blocks, qtype, k).double() - minimum.repeat_interleave(32, dim=1)
    sums = x.double().reshape(x.shape[0], -1, 32).sum(-1)
    return int8_rounded(x).double() @ codes_part.T + sums @ minimum.T


class RoundedActivations(nn.Module):
    """A float linear on a (dequantized) weight whose input is first rounded as the kernels round it: what a
    Q8_0 or Q5_0 linear computes (their offsets multiply the rounded activations too), up to float summation order."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.in_features = weight, bias, weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(int8_rounded(x), self.weight, self.bias)


def greedy_gaps(reference: nn.Module, prompts: list[list[int]], texts: list[list[int]]) -> torch.Tensor:
    """For each token an engine chose, how far its logit lies below the reference's largest at that point of the
    engine's own text. Rounding activations to int8 is a step function: an upstream difference of one ulp (the paged
    attention's sums against sdpa's) now and then moves a value across a rounding boundary, so near-ties may break
    either way and greedy texts part; the gaps stay small where the engine computes what the reference does."""
    gaps = []
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, texts, strict=True):
            logits = reference(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
            chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            gaps.append(logits.max(-1).values - chosen)
    return torch.cat(gaps)
