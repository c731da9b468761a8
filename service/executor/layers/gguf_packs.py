"""The packed types' rows regrouped into csrc/int4_linear.cpp's blocks of 16 rows (`pack_*`, each with its exact
inverse `unpack_*`), a slice of rows at a time (`pack_in_slices`), and single rows read in place (`q8_0_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.service.executor.layers.gguf_blocks import (
    BYTE_SHIFTS,
    PAIR_SHIFTS,
    bits32,
    iq4_xs_scales,
    k4_scales,
    k5_fifth_bits,
    q2_k_fields,
    q3_k_fields,
    split_nibbles,
)

PACK_ROWS = 16  # output rows per block of csrc/int4_linear.cpp
PACK_SLICE_BYTES = 8 << 20  # stored rows packed at a time


def pack_in_slices(pack, data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """pack(data) for one of the pack_* below, a slice of whole packs of rows at a time, into buffers allocated
    once: a pack's temporaries are several times its input (pack_q6_k's about 7x), which over a vocabulary-sized
    embedding added hundreds of MB to the load's peak. Every pack_* regroups each 16 rows on their own, so the
    slices' packs are the whole one's."""
    n = data.shape[0]
    step = max(PACK_ROWS, PACK_SLICE_BYTES // max(1, data.shape[1]) // PACK_ROWS * PACK_ROWS)
    if n <= step:
        return pack(data)
    out: tuple[torch.Tensor, ...] = ()
    for start in range(0, n, step):
        parts = pack(data[start:start + step])
        if not out:
            out = tuple(torch.empty(-(-n // PACK_ROWS), *p.shape[1:], dtype=p.dtype) for p in parts)
        for whole, part in zip(out, parts, strict=True):
            whole[start // PACK_ROWS:start // PACK_ROWS + len(part)] = part
    return out


def _k4_scale_bytes(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The inverse of k4_scales: eight 6-bit scales and minimums [nb, 8] → the 12 bytes."""
    return torch.cat([scale[:, :4] | ((scale[:, 4:] >> 4) << 6), minimum[:, :4] | ((minimum[:, 4:] >> 4) << 6),
                      (scale[:, 4:] & 15) | ((minimum[:, 4:] & 15) << 4)], dim=-1)


def _interleave(codes: torch.Tensor) -> torch.Tensor:
    """A group's code bytes in blocks of 16 rows [P, 16, G, B] (B: 16 bytes of Q4_1-ordered nibbles, or Q8_0's 32
    codes) → csrc/int4_linear.cpp's [P, G, B / 4, 16, 4] (chunk c, row o: bytes 4c..4c+3 of row o's group)."""
    words = codes.contiguous().view(torch.int32)  # [P, 16, G, B / 4]: four bytes move as one element
    packs, _, groups, chunks = words.shape
    return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(packs, groups, chunks, PACK_ROWS, 4)


def _deinterleave(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of _interleave."""
    return codes.permute(0, 3, 1, 2, 4).reshape(codes.shape[0], PACK_ROWS, codes.shape[1], -1)


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [P * 16, X, Y] → [P, X, Y, 16]: a block's 16 rows side by side, as the kernel reads them."""
    return t.reshape(-1, PACK_ROWS, *t.shape[1:]).permute(0, 2, 3, 1).contiguous()


def _by_row(t: torch.Tensor) -> torch.Tensor:
    """The inverse of _by_block."""
    return t.permute(0, 3, 1, 2).reshape(-1, *t.shape[1:3])


def _pack_nibble_rows(data: torch.Tensor, halves: int) -> tuple[torch.Tensor, ...]:
    """Rows of blocks of `halves` float16 values and 16 bytes of nibbles (Q4_0: d; Q4_1: d, m) → int4_linear's
    nibbles [N/16, G, 4, 16, 4] and each value float16 [N/16, G, 16], N padded with zero rows to blocks of 16."""
    n, nbytes = data.shape[0], 2 * halves + 16
    blocks = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, PACK_ROWS, data.shape[1] // nbytes, nbytes)
    values = (blocks[..., 2 * h:2 * h + 2].contiguous().view(torch.float16)[..., 0].transpose(1, 2).contiguous()
              for h in range(halves))
    return _interleave(blocks[..., 2 * halves:]), *values


def _unpack_nibble_rows(nibbles: torch.Tensor, values: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """The inverse of _pack_nibble_rows: the first n rows as stored."""
    packs, groups = nibbles.shape[:2]
    heads = [t.transpose(1, 2).contiguous().view(torch.uint8).reshape(packs, PACK_ROWS, groups, 2) for t in values]
    return torch.cat([*heads, _deinterleave(nibbles)], dim=-1).reshape(packs * PACK_ROWS, -1)[:n]


def pack_q4_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows uint8 [N, G * 18] → q4_0_linear's blocks of 16 rows (N padded with zero rows): nibbles
    [N/16, G, 4, 16, 4] as Q4_1's, d float16 [N/16, G, 16]. Every bit kept (unpack_q4_0)."""
    nibbles, scale = _pack_nibble_rows(data, 1)
    return nibbles, scale


def unpack_q4_0(nibbles: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q4_0: the first n rows as Q4_0 blocks, uint8 [n, G * 18]."""
    return _unpack_nibble_rows(nibbles, (scale,), n)


def pack_q4_1(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows uint8 [N, G * 20] → int4_linear's blocks of 16 rows (N padded with zero rows): nibbles
    [N/16, G, 4, 16, 4], scale and minimum float16 [N/16, G, 16]."""
    nibbles, scale, minimum = _pack_nibble_rows(data, 2)
    return nibbles, scale, minimum


def unpack_q4_1(nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q4_1: the first n rows as Q4_1 blocks, uint8 [n, G * 20]."""
    return _unpack_nibble_rows(nibbles, (scale, minimum), n)


def _negated(half: torch.Tensor) -> torch.Tensor:
    """float16 values with their sign bits flipped: -x, every bit kept (NaNs too, which float negation may not)."""
    return (half.view(torch.int16) ^ -0x8000).view(torch.float16)


def _supers(b: torch.Tensor, nb: int, at: int) -> torch.Tensor:
    """Blocks [16 P * nb, bytes] → the float16 d at byte `at` of each, per 16 rows: [P, nb, 16]."""
    return _by_block(b[:, at:at + 2].contiguous().view(torch.float16).reshape(-1, nb, 1)).reshape(-1, nb, PACK_ROWS)


def _supers_bytes(supers: torch.Tensor) -> torch.Tensor:
    """The inverse of _supers: each block's d as its 2 bytes, [16 P * nb, 2]."""
    packs, nb = supers.shape[:2]
    return _by_row(supers.reshape(packs, nb, 1, PACK_ROWS)).reshape(-1).view(torch.uint8).reshape(-1, 2)


def _d_dmin_supers(b: torch.Tensor, nb: int, at: int) -> torch.Tensor:
    """Blocks [16 P * nb, bytes] → their d and -dmin (float16 at bytes `at` and `at` + 2), per 16 rows: [P, nb, 2,
    16]."""
    d, dmin = (b[:, i:i + 2].contiguous().view(torch.float16) for i in (at, at + 2))
    return _by_block(torch.cat([d, _negated(dmin)], dim=-1).reshape(-1, nb, 2))


def _d_dmin_bytes(supers: torch.Tensor) -> torch.Tensor:
    """The inverse of _d_dmin_supers: each block's d and dmin as their 4 bytes, [16 P * nb, 4]."""
    d_dmin = _by_row(supers).reshape(-1, 2)
    return torch.stack([d_dmin[:, 0], _negated(d_dmin[:, 1])], dim=-1).contiguous().view(torch.uint8)


def _k4_packs(b: torch.Tensor, nb: int, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K or Q5_K blocks [16 P * nb, bytes] and their 128 bytes of nibbles → the codes' low four bits as
    int4_linear's nibbles [P, G, 4, 16, 4], each group's 6-bit scale and minimum [P, G, 2, 16], d and -dmin [P, nb, 2,
    16] (pack_q4_k)."""
    codes = split_nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)  # group 2j: chunk j's low nibbles, 2j+1 high
    nibbles = _interleave((codes[..., :16] | (codes[..., 16:] << 4)).reshape(-1, PACK_ROWS, nb * 8, 16))
    scale, minimum = k4_scales(b[:, 4:16])
    scales_mins = _by_block(torch.stack([scale, minimum], dim=-1).reshape(-1, nb * 8, 2))
    return nibbles, scales_mins, _d_dmin_supers(b, nb, 0)


def _k4_fields(nibbles: torch.Tensor, scales_mins: torch.Tensor, supers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of _k4_packs: each block's first 16 bytes (d, dmin, the 12 bytes of scales) and its 128 bytes
    of nibbles."""
    rows = _deinterleave(nibbles).reshape(-1, 8, 16)
    codes = torch.cat([rows & 15, rows >> 4], dim=-1).reshape(-1, 4, 2, 32)  # chunk j: group 2j low, 2j+1 high
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(-1, 128)
    sm = _by_row(scales_mins).reshape(-1, 8, 2)
    return torch.cat([_d_dmin_bytes(supers), _k4_scale_bytes(sm[..., 0], sm[..., 1])], dim=-1), qs


def pack_q4_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows uint8 [N, nb * 144] → q4_k_linear's blocks of 16 rows (N padded with zero rows): the codes as
    int4_linear's nibbles [N/16, G, 4, 16, 4] (G = 8 nb groups of 32), each group's 6-bit scale and minimum uint8
    [N/16, G, 2, 16], each 256 inputs' d and -dmin float16 [N/16, nb, 2, 16]. Every bit of the file is kept
    (unpack_q4_k gives the rows back), in 148 bytes per 144."""
    n, nb = data.shape[0], data.shape[1] // 144
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 144)
    return _k4_packs(b, nb, b[:, 16:])


def unpack_q4_k(nibbles: torch.Tensor, scales_mins: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q4_k: the first n rows as Q4_K blocks, uint8 [n, nb * 144]."""
    head, qs = _k4_fields(nibbles, scales_mins, supers)
    return torch.cat([head, qs], dim=-1).reshape(-1, nibbles.shape[1] // 8 * 144)[:n]


def pack_q5_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K rows uint8 [N, nb * 176] → q5_k_linear's blocks of 16 rows (N padded with zero rows): pack_q4_k's
    buffers, the codes' fifth bits (bit i of qh[l]: input 32 i + l's) ahead of each group's scales and minimums in
    one uint8 [N/16, G, 96] (the bits in pack_q5_0's order [16, 4], then [2, 16]). 180 bytes per 176, every bit kept."""
    n, nb = data.shape[0], data.shape[1] // 176
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 176)
    nibbles, scales_mins, supers = _k4_packs(b, nb, b[:, 48:])
    planes = _bit_plane(k5_fifth_bits(b).reshape(-1, 32))  # [rows * G, 4]
    planes = planes.reshape(-1, PACK_ROWS, nb * 8, 4).transpose(1, 2).reshape(-1, nb * 8, 64)
    return nibbles, torch.cat([planes, scales_mins.reshape(-1, nb * 8, 32)], dim=-1), supers


def unpack_q5_k(nibbles: torch.Tensor, high_scales_mins: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q5_k: the first n rows as Q5_K blocks, uint8 [n, nb * 176]."""
    packs, groups = nibbles.shape[:2]
    head, qs = _k4_fields(nibbles, high_scales_mins[..., 64:].reshape(packs, groups, 2, PACK_ROWS), supers)
    planes = high_scales_mins[..., :64].reshape(packs, groups, PACK_ROWS, 4).transpose(1, 2).reshape(-1, 4)
    bits = _plane_bits(planes).reshape(-1, 8, 32)  # [blocks, group i, l]
    qh = (bits.transpose(1, 2) << BYTE_SHIFTS).sum(-1, dtype=torch.uint8)
    return torch.cat([head, qh, qs], dim=-1).reshape(-1, groups // 8 * 176)[:n]


def _iq4_xs_scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The inverse of iq4_xs_scales: [nb, 8] → bytes 2-7 of each block."""
    high = ((scales >> 4).reshape(-1, 2, 4) << PAIR_SHIFTS).sum(-1, dtype=torch.uint8)
    return torch.cat([high, (scales[:, 0::2] & 15) | ((scales[:, 1::2] & 15) << 4)], dim=-1)


def pack_iq4_xs(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ4_XS rows uint8 [N, nb * 136] → iq4_xs_linear's blocks of 16 rows (N padded with zero rows): each group's
    nibbles (Q4_0's order) as int4_linear's [N/16, G, 4, 16, 4], its scale less 32 int8 [N/16, G, 16], each 256
    inputs' d float16 [N/16, nb, 16]. 138 bytes per 136, every bit kept (unpack_iq4_xs)."""
    n, nb = data.shape[0], data.shape[1] // 136
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 136)
    nibbles = _interleave(b[:, 8:].reshape(-1, PACK_ROWS, nb * 8, 16))
    scales = _by_block((iq4_xs_scales(b).view(torch.int8) - 32).reshape(-1, nb * 8, 1)).reshape(-1, nb * 8, PACK_ROWS)
    supers = _supers(b, nb, 0)
    return nibbles, scales, supers


def unpack_iq4_xs(nibbles: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_iq4_xs: the first n rows as IQ4_XS blocks, uint8 [n, nb * 136]."""
    packs, groups = nibbles.shape[:2]
    qs = _deinterleave(nibbles).reshape(-1, 128)
    sixbit = (_by_row(scales.reshape(packs, groups, 1, PACK_ROWS)).reshape(-1, 8) + 32).view(torch.uint8)
    d = _supers_bytes(supers)
    return torch.cat([d, _iq4_xs_scale_bytes(sixbit), qs], dim=-1).reshape(-1, groups // 8 * 136)[:n]


def _bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """One bit of each of a group's 32 codes [X, 32] → int4_linear.cpp's order [X, 4]: byte t holds in bit c input
    4c + t's and in bit 4 + c input 16 + 4c + t's."""
    planes = bits.reshape(-1, 8, 4)  # [X, 4 half + c, t]
    out = planes[:, 0].clone()
    for bit in range(1, 8):  # ORs of whole slices: a reduction over the two middle dims ran several times slower
        out |= planes[:, bit] << bit
    return out


def _plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """The inverse of _bit_plane: [X, 4] → [X, 32]."""
    return ((plane[:, None, None, :] >> _FIFTH_SHIFTS) & 1).reshape(-1, 32)


def _fifth_bit_bytes(qh: torch.Tensor) -> torch.Tensor:
    """Q5 blocks' fifth bits [nb, 4] (bit j of the little-endian word: element j) → int4_linear.cpp's order."""
    return _bit_plane(bits32(qh))


_FIFTH_SHIFTS = torch.arange(8, dtype=torch.uint8).reshape(2, 4, 1)  # half h, chunk c → bit 4h + c


def _qh_bytes(fifth: torch.Tensor) -> torch.Tensor:
    """The inverse of _fifth_bit_bytes."""
    bits = _plane_bits(fifth).reshape(-1, 4, 8)  # element 8i + k: byte i, bit k
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _pack_q5(data: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 (head 2: d) or Q5_1 (head 4: d, m) rows → nibbles, fifth bits, float16 scales (see pack_q5_0)."""
    n, nbytes = data.shape[0], head + 20
    blocks = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, PACK_ROWS, data.shape[1] // nbytes, nbytes)
    packs, _, groups, _ = blocks.shape
    nibbles = _interleave(blocks[..., head + 4:])
    fifth = _fifth_bit_bytes(blocks[..., head:head + 4].reshape(-1, 4)).reshape(packs, PACK_ROWS, groups, 4)
    halves = blocks[..., :head].contiguous().view(torch.float16)  # [P, 16, G, head / 2]
    scales = halves.permute(0, 2, 3, 1).contiguous()  # [P, G, head / 2, 16]
    return nibbles, fifth.transpose(1, 2).contiguous(), scales.squeeze(2) if head == 2 else scales


def _unpack_q5(nibbles: torch.Tensor, fifth: torch.Tensor, scales: torch.Tensor, n: int, head: int) -> torch.Tensor:
    packs, groups = nibbles.shape[:2]
    qh = _qh_bytes(fifth.transpose(1, 2).reshape(-1, 4)).reshape(packs, PACK_ROWS, groups, 4)
    halves = scales.reshape(packs, groups, head // 2, PACK_ROWS).permute(0, 3, 1, 2).contiguous()
    blocks = torch.cat([halves.view(torch.uint8), qh, _deinterleave(nibbles)], dim=-1)
    return blocks.reshape(packs * PACK_ROWS, -1)[:n]


def pack_q5_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 rows uint8 [N, G * 22] → q5_0_linear's blocks of 16 rows (N padded with zero rows): the low four bits of
    the codes as int4_linear's nibbles [N/16, G, 4, 16, 4], their fifth bits uint8 [N/16, G, 16, 4] (int4_linear.cpp
    gives the order), d float16 [N/16, G, 16]. 22 bytes per 22, every bit kept (unpack_q5_0)."""
    return _pack_q5(data, 2)


def unpack_q5_0(nibbles: torch.Tensor, fifth: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q5_0: the first n rows as Q5_0 blocks, uint8 [n, G * 22]."""
    return _unpack_q5(nibbles, fifth, scale, n, 2)


def pack_q5_1(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 rows uint8 [N, G * 24] → q5_1_linear's blocks: as pack_q5_0, with d and m float16 [N/16, G, 2, 16]."""
    return _pack_q5(data, 4)


def unpack_q5_1(nibbles: torch.Tensor, fifth: torch.Tensor, scale_min: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q5_1: the first n rows as Q5_1 blocks, uint8 [n, G * 24]."""
    return _unpack_q5(nibbles, fifth, scale_min, n, 4)


def _q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [B, 210] → their 6-bit codes in input order, uint8 [B, 256]."""
    ql = split_nibbles(b[:, :128].reshape(-1, 2, 64))  # per 128 inputs: bytes 0..63's low nibbles, then their high ones
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> PAIR_SHIFTS[:, None]) & 3  # input 32i + l: byte l, bits 2i, 2i+1
    return (ql | (qh.reshape(-1, 2, 128) << 4)).reshape(-1, 256)


def pack_q6_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows uint8 [N, nb * 210] → q6_k_linear's blocks of 16 rows (N padded with zero rows): the codes' low four
    bits as int4_linear's nibbles [N/16, G, 4, 16, 4] (G = 8 nb groups of 32); per group uint8 [N/16, G, 160], the
    bit-4 and bit-5 planes of the codes (each [16, 4] in the fifth bits' order, pack_q5_0) and the int8 scales of the
    group's two 16 inputs [2, 16]; each 256 inputs' d float16 [N/16, nb, 16]. 210 bytes per 210, every bit kept."""
    n, nb = data.shape[0], data.shape[1] // 210
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 210)
    codes = _q6_k_codes(b).reshape(-1, 32)  # [rows * G, 32]
    low = codes & 15
    nibbles = _interleave((low[:, :16] | (low[:, 16:] << 4)).reshape(-1, PACK_ROWS, nb * 8, 16))
    planes = torch.stack([_bit_plane((codes >> bit) & 1) for bit in (4, 5)], dim=1)  # [rows * G, 2, 4]
    planes = planes.reshape(-1, PACK_ROWS, nb * 8, 2, 4).permute(0, 2, 3, 1, 4).reshape(-1, nb * 8, 128)
    scales = _by_block(b[:, 192:208].reshape(-1, nb * 8, 2)).reshape(-1, nb * 8, 32)
    supers = _supers(b, nb, 208)
    return nibbles, torch.cat([planes, scales], dim=-1).contiguous(), supers


def unpack_q6_k(nibbles: torch.Tensor, high_scales: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q6_k: the first n rows as Q6_K blocks, uint8 [n, nb * 210]."""
    packs, groups = nibbles.shape[:2]
    nb = groups // 8
    rows = _deinterleave(nibbles).reshape(-1, 16)  # [rows * G, 16]
    planes = high_scales[..., :128].reshape(packs, groups, 2, PACK_ROWS, 4).permute(0, 3, 1, 2, 4).reshape(-1, 4)
    high = _plane_bits(planes).reshape(-1, 2, 32)  # [rows * G, bit 4 | bit 5, 32]
    codes = torch.cat([rows & 15, rows >> 4], dim=-1) | (high[:, 0] << 4) | (high[:, 1] << 5)
    e = codes.reshape(-1, 2, 2, 64)  # per 128 inputs: 0..63, 64..127
    ql = (e[:, :, 0] & 15) | ((e[:, :, 1] & 15) << 4)  # [B, 2, 64]
    qh = ((e.reshape(-1, 2, 4, 32) >> 4) << PAIR_SHIFTS[:, None]).sum(2, dtype=torch.uint8)  # [B, 2, 32]
    scales = _by_row(high_scales[..., 128:].reshape(packs, groups, 2, PACK_ROWS)).reshape(-1, 16)
    d = _supers_bytes(supers)
    blocks = torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, d], dim=-1)
    return blocks.reshape(-1, nb * 210)[:n]


def _q3_k_bytes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of q3_k_fields: each block's first 108 bytes (hmask, qs, the 12 bytes of scales)."""
    hmask = ((codes >> 2) << BYTE_SHIFTS[:, None]).sum(1, dtype=torch.uint8)
    qs = ((codes & 3).reshape(-1, 2, 4, 32) << PAIR_SHIFTS[:, None]).sum(2, dtype=torch.uint8).reshape(-1, 64)
    high = ((scales >> 4).reshape(-1, 4, 4) << PAIR_SHIFTS[:, None]).sum(1, dtype=torch.uint8)
    return torch.cat([hmask, qs, (scales[:, :8] & 15) | (scales[:, 8:] << 4), high], dim=-1)


def pack_q3_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q3_K rows uint8 [N, nb * 110] → q3_k_linear's blocks of 16 rows (N padded with zero rows): the codes q + 4 as
    int4_linear's nibbles [N/16, G, 4, 16, 4] (G = 8 nb groups of 32), the scale less 32 of each 16 inputs int8
    [N/16, G, 2, 16], each 256 inputs' d float16 [N/16, nb, 16]. Every bit kept (unpack_q3_k), in 146 bytes per 110:
    a nibble per 3-bit code, where the file's bit planes would take Q6_K's kernel (210 bytes)."""
    n, nb = data.shape[0], data.shape[1] // 110
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 110)
    codes, scales = q3_k_fields(b)
    codes = codes.reshape(-1, 32)  # [rows * G, 32]
    nibbles = _interleave((codes[:, :16] | (codes[:, 16:] << 4)).reshape(-1, PACK_ROWS, nb * 8, 16))
    signed = _by_block((scales.view(torch.int8) - 32).reshape(-1, nb * 8, 2))
    supers = _supers(b, nb, 108)
    return nibbles, signed, supers


def unpack_q3_k(nibbles: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q3_k: the first n rows as Q3_K blocks, uint8 [n, nb * 110]."""
    packs, groups = nibbles.shape[:2]
    rows = _deinterleave(nibbles).reshape(-1, 16)  # [rows * G, 16]
    codes = torch.cat([rows & 15, rows >> 4], dim=-1).reshape(-1, 8, 32)
    sixbit = (_by_row(scales).reshape(-1, 16) + 32).view(torch.uint8)
    d = _supers_bytes(supers)
    return torch.cat([_q3_k_bytes(codes, sixbit), d], dim=-1).reshape(-1, groups // 8 * 110)[:n]


def pack_q2_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K rows uint8 [N, nb * 84] → q2_k_linear's blocks of 16 rows (N padded with zero rows): the 2-bit codes four
    to a byte [N/16, G, 2, 16, 4] (chunk c, row o, byte t: in bits 2p, 2p + 1 the code of input 16c + 4p + t), each
    16 inputs' scale and minimum uint8 [N/16, G, 2, 2, 16] (the group's two scales, then its two minimums), each 256
    inputs' d and -dmin float16 [N/16, nb, 2, 16]. Every bit kept (unpack_q2_k), in 100 bytes per 84."""
    n, nb = data.shape[0], data.shape[1] // 84
    b = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, 84)
    codes, scale, minimum = q2_k_fields(b)
    crumbs = (codes.reshape(-1, 2, 4, 4) << PAIR_SHIFTS[:, None]).sum(2, dtype=torch.uint8)  # [rows * G, c, t]
    packed = _interleave(crumbs.reshape(-1, PACK_ROWS, nb * 8, 8))
    per_group = torch.stack([scale.reshape(-1, nb * 8, 2), minimum.reshape(-1, nb * 8, 2)], dim=2)
    scales_mins = _by_block(per_group.reshape(-1, nb * 8, 4)).reshape(-1, nb * 8, 2, 2, PACK_ROWS)
    return packed, scales_mins, _d_dmin_supers(b, nb, 80)


def unpack_q2_k(packed: torch.Tensor, scales_mins: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q2_k: the first n rows as Q2_K blocks, uint8 [n, nb * 84]."""
    packs, groups = packed.shape[:2]
    crumbs = _deinterleave(packed).reshape(-1, 2, 1, 4)  # [rows * G, c, 1, t]
    codes = ((crumbs >> PAIR_SHIFTS[:, None]) & 3).reshape(-1, 2, 4, 32)  # [blocks, h, t, l]: input 32 (4h + t) + l
    qs = (codes << PAIR_SHIFTS[:, None]).sum(2, dtype=torch.uint8).reshape(-1, 64)
    per_group = _by_row(scales_mins.reshape(packs, groups, 4, PACK_ROWS)).reshape(-1, 8, 2, 2)  # [blocks, g, sm, h]
    scale, minimum = per_group[:, :, 0].reshape(-1, 16), per_group[:, :, 1].reshape(-1, 16)
    return torch.cat([scale | (minimum << 4), qs, _d_dmin_bytes(supers)], dim=-1).reshape(-1, groups // 8 * 84)[:n]


def pack_q8_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows uint8 [N, G * 34] → q8_0_packed_linear's blocks of 16 rows (N padded with zero rows): the codes
    q + 128 as uint8 [N/16, G, 8, 16, 4] (chunk c, row o: inputs 4c..4c+3 of row o's group) and d float16
    [N/16, G, 16]. 34 bytes per 34, every bit kept (unpack_q8_0)."""
    n = data.shape[0]
    blocks = F.pad(data, (0, 0, 0, -n % PACK_ROWS)).reshape(-1, PACK_ROWS, data.shape[1] // 34, 34)
    codes = _interleave(blocks[..., 2:] ^ 0x80)
    scale = blocks[..., :2].contiguous().view(torch.float16)[..., 0].transpose(1, 2).contiguous()
    return codes, scale


def unpack_q8_0(codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q8_0: the first n rows as Q8_0 blocks, uint8 [n, G * 34]."""
    packs, groups = codes.shape[:2]
    q = _deinterleave(codes ^ 0x80)
    d = scale.transpose(1, 2).contiguous().view(torch.uint8).reshape(packs, PACK_ROWS, groups, 2)
    return torch.cat([d, q], dim=-1).reshape(packs * PACK_ROWS, -1)[:n]


def q8_0_rows(codes: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [n]) of pack_q8_0's buffers as Q8_0 blocks, uint8 [n, G * 34], each read where it lies."""
    packs, lanes = ids // PACK_ROWS, ids % PACK_ROWS
    q = codes[packs, :, :, lanes] ^ 0x80  # [n, G, 8, 4]
    d = scale[packs, :, lanes].contiguous().view(torch.uint8)  # [n, G * 2]
    n, groups = q.shape[:2]
    return torch.cat([d.view(n, groups, 2), q.reshape(n, groups, 32)], dim=-1).reshape(n, -1)
