"""Paged attention over packed variable-length sequences: plain torch, FlexAttention (`flex_attention.py`) or
flash-attn, picked per step by `AttentionMetadata.backend` (see `resolve_backend`).

Query i of a sequence with kv length L and q length Q sees kv positions j <= L - Q + i (and, with a sliding
window W, j > L - Q + i - W). Decodes (Q == 1) are batched into one gather + one SDPA call; prefill chunks run
one SDPA call per sequence. Everything that depends only on the step's metadata (gather indices, masks) is built
once per step in `AttentionMetadata` and reused by every layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

try:  # optional CUDA kernel; the torch path below is the reference
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

from sluice.kvcache.transfer import to_device
from sluice.service.attention import flex_attention as flex
from sluice.service.attention import triton_decode, triton_varlen

if TYPE_CHECKING:
    from sluice.service.attention.decode_kernel import DecodeKernel

# The most query rows of one sequence that the C kernel attends as decodes (verify steps: 1 + up to 16 drafts)
# unless the runner knows it takes every layer (AttentionMetadata.build's kernel_rows_max): a layer it cannot take
# (a sliding window, a softcap) attends those rows on the torch path, which gathers each row's whole context.
KERNEL_ROWS_MAX = 17
# flash-attn 2 only accepts paged caches whose block size is a multiple of 256.
FLASH_BLOCK_MULTIPLE = 256
BACKENDS = ("auto", "torch", "flex", "flash", "triton")


def resolve_backend(name: str, device: torch.device, block_size: int, mixed_dtypes: bool = False) -> str:
    """'auto': flash-attn on CUDA when installed and the block size fits it, else the Triton kernels (one launch
    per layer for the whole step), else FlexAttention; on CPU the torch path (SDPA, and the C decode kernel). A
    cache stored in another dtype than the queries (`mixed_dtypes`) is read by the torch path only. An explicit
    choice that cannot run here is a ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if mixed_dtypes:
        if name not in ("auto", "torch"):
            raise ValueError(f"attention backend {name} reads a KV cache of the model's dtype only: use "
                             "--attention-backend torch or --kv-cache-dtype auto")
        return "torch"
    flash_fits = flash_attn_varlen_func is not None and device.type == "cuda" and block_size % FLASH_BLOCK_MULTIPLE == 0
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        if flash_fits:
            return "flash"
        return "triton" if triton_decode.available(device) else "flex" if flex.available(device, block_size) \
            else "torch"
    if name == "triton" and not triton_decode.available(device):
        raise ValueError("the triton attention backend needs CUDA and the triton package")
    if name == "flash" and not flash_fits:
        raise ValueError(f"flash attention needs flash-attn, CUDA and a block size multiple of {FLASH_BLOCK_MULTIPLE}")
    if name == "flex" and not flex.available(device, block_size):
        raise ValueError(f"flex attention needs torch.nn.attention.flex_attention and, on CUDA, a block size of at "
                         f"least {flex.MIN_CUDA_BLOCK_SIZE}")
    return name


@dataclass(slots=True)
class DecodeBatch:
    """The step's query rows attended one at a time: the q_len == 1 sequences, and with the C kernel the rows of
    sequences with up to kernel_rows_max of them (AttentionMetadata.build), each row a decode over its sequence's
    blocks."""

    rows: torch.Tensor | slice  # their token rows in the packed batch
    block_ids: torch.Tensor  # [n * num_blocks] flattened, padded block tables of the rows' sequences
    num_rows: int  # n
    padded_len: int  # num_blocks * block_size
    seq_lens: torch.Tensor  # [n] long, device: the kv length each row sees, itself included
    tables: torch.Tensor  # [n, >= num_blocks] long, rows contiguous: the block tables the C kernel reads
    kernel: DecodeKernel | None = None  # the C kernel that reads blocks in place (CPU), if built
    masks: dict = field(default_factory=dict)  # sliding_window -> [n, 1, 1, padded_len] bool, or None
    plans: dict = field(default_factory=dict)  # (stores K/V, dtype, heads, kv heads, dim, scale) -> DecodePlan


@dataclass(slots=True)
class DecodeTables:
    """A step of decodes on the persistent buffers, attended by the Triton kernel (`triton_decode.py`): each
    row's block table and kv length are read on the device, so the step's work depends on its row count only
    (what a CUDA graph of the decode step captures)."""

    block_tables: torch.Tensor  # [n, max_blocks]
    seq_lens: torch.Tensor  # [n] long: each row's kv length, its new token included


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with q_len > 1 (a prompt chunk, maybe on top of cached context)."""

    start: int  # its rows in the packed batch: start .. start + q_len
    q_len: int
    kv_len: int
    block_ids: torch.Tensor  # the blocks holding kv positions 0 .. kv_len - 1
    masks: dict = field(default_factory=dict)  # sliding_window -> [q_len, kv_len] bool, or None (plain causal)


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's new K/V go, and which cached K/V each sequence attends over."""

    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, device
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_seqs] int32: kv length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    block_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    decode: DecodeBatch | None
    prefills: list[PrefillSeq]
    backend: str = "torch"  # resolved: torch, flex, flash or triton
    flex_groups: list = field(default_factory=list)  # the flex backend's calls (flex_attention.FlexGroup)
    tables: DecodeTables | None = None  # a decode step for the Triton kernel (for_decode_tables)
    varlen: triton_varlen.VarlenStep | None = None  # the triton backend's step: every sequence in one launch

    @classmethod
    def for_decode_tables(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                          block_size: int, max_seqlen_k: int) -> AttentionMetadata:
        """A decode step read from device tensors only (no host lengths): `max_seqlen_k` bounds what any row
        may see (a captured step serves every later one of its size, so it is the longest a sequence gets)."""
        device = block_tables.device
        cu_q = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=device)
        cu_k = torch.cat((cu_q[:1], seq_lens.cumsum(0).to(torch.int32)))
        return cls(slot_mapping=slot_mapping, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_lens=seq_lens,
                   block_tables=block_tables, block_size=block_size, max_seqlen_q=1, max_seqlen_k=max_seqlen_k,
                   decode=None, prefills=[], backend="triton", tables=DecodeTables(block_tables, seq_lens))

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        decode_kernel: DecodeKernel | None = None,
        backend: str = "auto",
        seq_lens_tensor: torch.Tensor | None = None,
        kernel_rows_max: int = KERNEL_ROWS_MAX,
    ) -> AttentionMetadata:
        """Metadata for sequences packed in order; lengths are host lists so planning needs no device sync.
        A step of decodes only may pass int64 block tables and seq_lens_tensor (its lengths, long, on the device):
        the decode kernel then reads those tensors in place (a decode step's persistent buffers). Sequences of up
        to kernel_rows_max query rows go to the decode kernel (where there is one), longer ones to SDPA."""
        device = block_tables.device
        backend = resolve_backend(backend, device, block_size)
        cu_q, cu_k = [0, *itertools.accumulate(query_lens)], [0, *itertools.accumulate(seq_lens)]
        decode, prefills, groups, varlen = None, [], [], None
        if backend == "triton":
            varlen = triton_varlen.VarlenStep(query_lens, seq_lens, cu_q)
        elif backend == "flex":
            groups = flex.plan_groups(query_lens, seq_lens, cu_q, block_tables, block_size)
        else:
            # With the C kernel, query rows of one sequence (a verify step's drafts, a prompt chunk) are decodes
            # too, each seeing the cache up to its own position: the kernel reads the blocks in place, where the
            # prefill path gathers the whole context for one SDPA call per sequence.
            rows_max = kernel_rows_max if decode_kernel is not None and backend == "torch" else 1
            decode_idx = [i for i, n in enumerate(query_lens) if n <= rows_max]
            if decode_idx:
                decode = _plan_decode(decode_idx, cu_q, query_lens, seq_lens, block_tables, block_size,
                                      decode_kernel, seq_lens_tensor if len(decode_idx) == len(query_lens) else None)
            prefills = [PrefillSeq(cu_q[i], n, seq_lens[i], block_tables[i, : -(-seq_lens[i] // block_size)].long())
                        for i, n in enumerate(query_lens) if n > rows_max]
        return cls(slot_mapping=slot_mapping, cu_seqlens_q=to_device(cu_q, torch.int32, device),
                   cu_seqlens_k=to_device(cu_k, torch.int32, device), seq_lens=to_device(seq_lens, torch.int32, device),
                   block_tables=block_tables, block_size=block_size, max_seqlen_q=max(query_lens, default=0),
                   max_seqlen_k=max(seq_lens, default=0), decode=decode, prefills=prefills, backend=backend,
                   flex_groups=groups, varlen=varlen)


def _plan_decode(idx: list[int], cu_q: list[int], query_lens: list[int], seq_lens: list[int], block_tables,
                 block_size, kernel: DecodeKernel | None, seq_lens_tensor: torch.Tensor | None) -> DecodeBatch:
    """Gather indices for all decode rows at once (row j of a sequence with q rows and kv length L sees L - q + j
    + 1 tokens); rows stay a slice when the decodes are packed contiguously."""
    device = block_tables.device
    row_ids = [cu_q[i] + j for i in idx for j in range(query_lens[i])]
    seq_of_row = [i for i in idx for _ in range(query_lens[i])]
    lens = [seq_lens[i] - query_lens[i] + j + 1 for i in idx for j in range(query_lens[i])]
    first, last = row_ids[0], row_ids[-1]
    contiguous = last - first == len(row_ids) - 1
    one_row_each = len(row_ids) == len(idx)
    rows = slice(first, last + 1) if contiguous else to_device(row_ids, torch.long, device)
    num_blocks = -(-max(lens) // block_size)
    if one_row_each:
        seq_index = slice(idx[0], idx[-1] + 1) if contiguous else to_device(idx, torch.long, device)
    else:
        seq_index = to_device(seq_of_row, torch.long, device)
    tables = block_tables[seq_index, :num_blocks]
    block_ids = tables.reshape(-1).long()
    # every sequence is one decode row: the persistent buffers' tables and lengths are read in place
    in_place = seq_lens_tensor is not None and block_tables.dtype == torch.long and one_row_each
    return DecodeBatch(
        rows=rows,
        block_ids=block_ids,
        num_rows=len(row_ids),
        padded_len=num_blocks * block_size,
        seq_lens=to_device(lens, torch.long, device) if seq_lens_tensor is None else seq_lens_tensor,
        tables=block_tables if in_place else block_ids.view(len(row_ids), num_blocks),
        kernel=kernel,
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache, value_cache, slot_mapping) -> None:
    """Store the step's new keys/values [num_tokens, num_kv_heads, head_dim] into their slots (rounded to the
    cache's dtype where it is narrower)."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend: query [T, H, D] → output [T, H, D]."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    decode = meta.decode
    if meta.backend == "torch" and decode is not None and decode.num_rows == query.shape[0] and not meta.prefills \
            and _kernel_runs(decode.kernel, query, key_cache, sliding_window, softcap):
        return _kernel_decode(query, key, value, key_cache, value_cache, decode, meta.slot_mapping, scale)
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    if meta.tables is not None:
        return triton_decode.paged_decode(query, key_cache, value_cache, meta.tables.block_tables,
                                          meta.tables.seq_lens, scale, sliding_window, softcap)
    if meta.varlen is not None:
        step = meta.varlen.plan_for(query.shape[1] // key_cache.shape[2], query.device)
        return triton_varlen.paged_varlen(query, key_cache, value_cache, meta.block_tables, step, scale,
                                          sliding_window, softcap)
    if meta.backend == "flex":
        return flex.flex_paged_attention(query, key_cache, value_cache, meta.flex_groups, meta.block_size, scale,
                                         sliding_window, softcap)
    if meta.backend == "flash" and _can_use_flash(query, meta):
        return _flash_attention(query, key_cache, value_cache, meta, scale, sliding_window, softcap)
    num_tokens = query.shape[0]
    prefills = meta.prefills
    if decode is not None and not prefills and decode.num_rows == num_tokens:
        return _decode_attention(query, key_cache, value_cache, decode, scale, sliding_window, softcap)
    if decode is None and len(prefills) == 1 and prefills[0].q_len == num_tokens:
        return _prefill_attention(
            query, key, value, key_cache, value_cache, prefills[0], scale, sliding_window, softcap
        )
    out = torch.empty_like(query)
    if decode is not None:
        q = query[decode.rows]
        out[decode.rows] = _decode_attention(q, key_cache, value_cache, decode, scale, sliding_window, softcap)
    for seq in prefills:
        rows = slice(seq.start, seq.start + seq.q_len)
        out[rows] = _prefill_attention(
            query[rows], key[rows], value[rows], key_cache, value_cache, seq, scale, sliding_window, softcap
        )
    return out


def _kernel_runs(kernel: DecodeKernel | None, query, key_cache, window, softcap) -> bool:
    return kernel is not None and window is None and not softcap and kernel.supports(query, key_cache)


def _kernel_decode(query, key, value, key_cache, value_cache, decode: DecodeBatch, slot_mapping, scale):
    """Decodes on the C kernel, one call per layer. With key/value/slot_mapping it stores the new K/V too (a
    decode-only step); with None they were stored already (decodes beside prefills)."""
    shape = (slot_mapping is not None, query.dtype, query.shape[1], key_cache.shape[2], query.shape[2], scale)
    plan = decode.plans.get(shape)
    if plan is None:  # the first layer of the step (or of a new head shape)
        plan = decode.plans[shape] = decode.kernel.plan(query, key_cache, decode.tables, decode.seq_lens, slot_mapping,
                                                        scale)
    return decode.kernel.decode_step(plan, query, key, value, key_cache, value_cache)


def _decode_attention(query, key_cache, value_cache, decode: DecodeBatch, scale, window, softcap) -> torch.Tensor:
    """One query token per sequence: query [n, H, D] against each sequence's gathered blocks."""
    n, num_heads, head_dim = query.shape
    kernel = decode.kernel
    if _kernel_runs(kernel, query, key_cache, window, softcap):
        return _kernel_decode(query, None, None, key_cache, value_cache, decode, None, scale)
    num_kv_heads = key_cache.shape[2]
    # [n, L, Hkv, D] viewed as [n, Hkv, L, D]; strided, but SDPA reads it without another copy.
    k = key_cache.index_select(0, decode.block_ids).to(query.dtype)
    v = value_cache.index_select(0, decode.block_ids).to(query.dtype)
    k = k.view(n, decode.padded_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(n, decode.padded_len, num_kv_heads, head_dim).transpose(1, 2)
    # Grouped heads become the query-length axis, so GQA needs no repeated K/V and the mask broadcasts.
    q = query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = decode.masks.get(window, False)
    if mask is False:
        mask = decode.masks[window] = _decode_mask(decode, window)
    out = _attend(q, k, v, mask, False, scale, softcap)
    return out.reshape(n, num_heads, head_dim)


def _decode_mask(decode: DecodeBatch, window: int | None) -> torch.Tensor:
    """[n, 1, 1, L] True where kv position j < seq_len (and j > seq_len - 1 - window)."""
    pos = torch.arange(decode.padded_len, device=decode.seq_lens.device)
    lens = decode.seq_lens[:, None]
    mask = pos < lens
    if window is not None:
        mask &= pos > lens - 1 - window
    return mask[:, None, None, :]


def _prefill_attention(query, key, value, key_cache, value_cache, seq: PrefillSeq, scale, window, softcap):
    """One sequence's chunk: query [Q, H, D]; the new key/value [Q, Hkv, D] are already in the cache."""
    if seq.kv_len == seq.q_len:
        k, v = key, value  # no cached context: attend over the new tokens directly, no gather
        if key_cache.dtype != key.dtype:  # as rounded in the cache, so a later chunk or a prefix hit sees the same
            k, v = k.to(key_cache.dtype).to(key.dtype), v.to(value_cache.dtype).to(value.dtype)
    else:
        head_shape = key_cache.shape[2:]
        k = key_cache.index_select(0, seq.block_ids).view(-1, *head_shape)[: seq.kv_len].to(query.dtype)
        v = value_cache.index_select(0, seq.block_ids).view(-1, *head_shape)[: seq.kv_len].to(query.dtype)
    mask = seq.masks.get(window, False)
    if mask is False:
        mask = seq.masks[window] = _prefill_mask(seq, window, query.device)
    out = _attend(query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, mask is None,
                  scale, softcap)
    return out[0].transpose(0, 1)


def _prefill_mask(seq: PrefillSeq, window: int | None, device) -> torch.Tensor | None:
    """[Q, L] bottom-right causal mask (plus window); None when SDPA's own causal flag is exact."""
    if seq.kv_len == seq.q_len and (window is None or window >= seq.kv_len):
        return None
    pos_q = torch.arange(seq.kv_len - seq.q_len, seq.kv_len, device=device)[:, None]
    pos_k = torch.arange(seq.kv_len, device=device)[None, :]
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return mask


def _attend(q, k, v, mask, is_causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention with q [B, H, Q, D] and k/v [B, Hkv, L, D], H a multiple of Hkv; mask True = visible."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    # SDPA has no softcap; this eager path is only taken by models that need one (e.g. Gemma 2).
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def _can_use_flash(query: torch.Tensor, meta: AttentionMetadata) -> bool:
    """flash-attn's paged kernel: CUDA, fp16/bf16, and a block size it accepts."""
    return (
        flash_attn_varlen_func is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and meta.block_size % FLASH_BLOCK_MULTIPLE == 0
    )


def _flash_attention(query, key_cache, value_cache, meta: AttentionMetadata, scale, window, softcap):
    """flash-attn varlen over the paged cache; its causal mask is bottom-right aligned, as needed here."""
    return flash_attn_varlen_func(
        query,
        key_cache,
        value_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        softcap=softcap or 0.0,
        block_table=meta.block_tables,
    )
