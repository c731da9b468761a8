"""GGUF's block formats in plain torch: a weight as stored (`GgufBlocks`), the field readers the dequantizers of
quant_types.py and the packs of gguf_packs.py share, and `quantize` of float weights into Q8_0 and Q4_1 (what
`--quantization int8 | int4` stores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GgufBlocks:
    """A weight as a GGUF file stores it: `data` uint8 [N, row_bytes], each row its K / QK blocks of `qtype`."""

    data: torch.Tensor
    qtype: str
    in_features: int


def half_at(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Blocks [nb, bytes] → the float16 field at byte `at` of each, as float32 [nb, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes → [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


BYTE_SHIFTS = torch.arange(8, dtype=torch.uint8)
PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def bits32(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes → [nb, 32]: bit j of the little-endian 32-bit word."""
    return ((qh[:, :, None] >> BYTE_SHIFTS) & 1).reshape(-1, 32)


def k5_fifth_bits(b: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [nb, 176] → their codes' fifth bits uint8 [nb, 8, 32]: sub-block i, input l is bit i of qh[l]."""
    return ((b[:, 16:48, None] >> BYTE_SHIFTS) & 1).transpose(1, 2)


def k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes → eight 6-bit scales and minimums, uint8 [nb, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    minimum = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scale, minimum


GROUP = 32  # inputs per Q8_0 / Q4_1 block
QUANTIZE_CHUNK_BYTES = 32 << 20  # float32 weights quantized at a time


def quantize(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """float weight [N, K] → its rows as Q8_0 or Q4_1 blocks, uint8 [N, K / 32 * bytes]. Q8_0: d = max|w| / 127,
    q = round(w / d); Q4_1: m = min, d = range / 15, q = round((w - m) / d) in 0..15 (byte j: element j in the low
    nibble, j + 16 in the high one). Each rounded against the float16 values stored, so weights dequantized from
    these formats (the default model's) come back bit for bit."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{qtype} blocks need in_features divisible by {GROUP}, not {k}")
    # Rows are blocks of their own: a few MB of them at a time keep the float temporaries (five or six of the
    # slice's size) from adding a vocabulary-sized embedding's several times over to the load's peak.
    step = max(1, QUANTIZE_CHUNK_BYTES // (4 * k))
    out = None
    for start in range(0, n, step):
        rows = _quantize_rows(weight[start:start + step], qtype)
        if out is None:
            out = torch.empty(n, rows.shape[1], dtype=torch.uint8, device=rows.device)
        out[start:start + len(rows)] = rows
    return _quantize_rows(weight, qtype) if out is None else out


def _quantize_rows(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if qtype == "Q8_0":
        d = (w.abs().amax(-1) / 127).half()
        df = d.float()[..., None]
        q = torch.where(df > 0, torch.round(w / torch.where(df > 0, df, 1.0)), 0.0).clamp_(-127, 127).to(torch.int8)
        parts = [d[..., None].view(torch.uint8), q.view(torch.uint8)]
    elif qtype == "Q4_1":
        low, high = w.amin(-1), w.amax(-1)
        m, d = low.half(), ((high - low) / 15).half()
        df, mf = d.float()[..., None], m.float()[..., None]
        q = torch.where(df > 0, torch.round((w - mf) / df.clamp_min(1e-30)), 0.0).clamp_(0, 15).to(torch.uint8)
        parts = [d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    else:
        raise ValueError(f"no quantization to {qtype}: Q8_0 or Q4_1")
    return torch.cat(parts, dim=-1).reshape(n, -1)


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [nb, 136] → their eight 6-bit scales uint8 [nb, 8]: group g's low nibble in byte 4 + g / 2 at
    bit 4 (g % 2), its high two bits in scales_h (bytes 2-3) at bit 2g."""
    low = torch.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], dim=-1).reshape(-1, 8)
    high = ((b[:, 2:4, None] >> PAIR_SHIFTS) & 3).reshape(-1, 8)
    return low | (high << 4)


def q3_k_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks [nb, 110] → their codes q + 4 (0..7) uint8 [nb, 8, 32] (input 32 i + l: the low two bits at bit
    2 (i % 4) of qs[32 (i / 4) + l], the third at bit i of hmask[l]) and their sixteen 6-bit scales uint8 [nb, 16]
    (s's low nibble in byte 96 + s % 8 at bit 4 (s / 8), its high two bits in byte 104 + s % 4 at bit 2 (s / 4))."""
    low = ((b[:, 32:96].reshape(-1, 2, 1, 32) >> PAIR_SHIFTS[:, None]) & 3).reshape(-1, 8, 32)
    third = (b[:, None, :32] >> BYTE_SHIFTS[:, None]) & 1
    sc = b[:, 96:108]
    high = ((sc[:, None, 8:12] >> PAIR_SHIFTS[:, None]) & 3).reshape(-1, 16)
    return low | (third << 2), torch.cat([sc[:, :8] & 15, sc[:, :8] >> 4], dim=-1) | (high << 4)


def q2_k_fields(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K blocks [nb, 84] → their 2-bit codes uint8 [nb, 8, 32] (input 32 i + l's at bit 2 (i % 4) of
    qs[32 (i / 4) + l], qs from byte 16) and each 16 inputs' 4-bit scale and minimum uint8 [nb, 16] (bytes 0-15: the
    scale in the low nibble, the minimum in the high one)."""
    codes = ((b[:, 16:80].reshape(-1, 2, 1, 32) >> PAIR_SHIFTS[:, None]) & 3).reshape(-1, 8, 32)
    return codes, b[:, :16] & 15, b[:, :16] >> 4
