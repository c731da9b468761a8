"""The linears that add LoRA deltas, punica-style: each step's rows are grouped by the adapter slot they run with.

A `LoRALinear` wraps one of the owned model's (possibly fused) linears. For every adapter slot it holds A, the
parts' A matrices stacked along the rank [P*R, in], and B block-diagonal [out, P*R] (part p's rows read only part
p's ranks), so a fused q/k/v or gate/up linear applies each part's own adapter in two matmuls. Rows of the base
model (and padding rows) are not touched; a step without adapter rows costs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sluice.service.executor.forward_context import get_forward_context
from sluice.service.executor.lora.adapter import FUSED_PARTS, LoRAWeights


@dataclass(slots=True)
class LoRABatch:
    """One step's adapter rows: for each slot in use, the packed token rows that run with it."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, row indices [n] long, on the model's device)


def lora_batch_of(slot_per_request: list[int], rows_per_request: list[int],
                  device: torch.device) -> LoRABatch | None:
    """The LoRABatch of a step whose requests take `rows_per_request` consecutive packed rows each, with the
    adapter slot each runs with (-1: the base model); None when no request has an adapter."""
    if all(s < 0 for s in slot_per_request):
        return None
    slots = torch.repeat_interleave(torch.tensor(slot_per_request), torch.tensor(rows_per_request))
    groups = [(s, (slots == s).nonzero()[:, 0].to(device, non_blocking=True))
              for s in sorted(set(slot_per_request)) if s >= 0]
    return LoRABatch(groups)


class LoRALinear(nn.Module):
    """base(x) plus, for the rows of each adapter slot, (x A_slot^T) B_slot^T (the adapter's scale is in B)."""

    def __init__(self, base: nn.Module, sizes: list[int], num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.base, self.sizes, self.max_rank = base, sizes, max_rank
        self.in_features, self.out_features = base.in_features, base.out_features
        width = len(sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(num_slots, width, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, self.out_features, width, dtype=dtype, device=device))

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load each part's (A [r, in], B [out_p, r]) into `slot` (None: that part has no adapter)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        row = 0
        for p, (size, part) in enumerate(zip(self.sizes, parts, strict=True)):
            if part is not None:
                a, b = part
                r, first = a.shape[0], p * self.max_rank
                self.lora_a[slot, first:first + r].copy_(a, non_blocking=True)
                self.lora_b[slot, row:row + size, first:first + r].copy_(b, non_blocking=True)
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → [T, out]."""
        out = self.base(x)
        batch = get_forward_context().lora
        if batch is None:
            return out
        for slot, rows in batch.groups:
            xs = x.index_select(0, rows)
            out.index_add_(0, rows, (xs @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return out


def wrap_model(model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
               device: torch.device) -> list[dict[str, LoRALinear]]:
    """Wrap the four linears of every layer of an owned model in LoRALinears; per layer, fused name -> wrapper.
    A layer's fast C++ path keeps the base linears it was built on (it runs only for steps without adapters)."""
    wrapped = []
    for layer in model.layers:
        owners = {"self_attn": layer.self_attn, "mlp": layer.mlp}
        mine = {}
        for fused, parts in FUSED_PARTS.items():
            owner_name, attr = fused.split(".")
            owner = owners[owner_name]
            base = getattr(owner, attr)
            sizes = _part_sizes(base, len(parts), owner)
            mine[fused] = LoRALinear(base, sizes, num_slots, max_rank, dtype, device)
            setattr(owner, attr, mine[fused])
        wrapped.append(mine)
    return wrapped


def _part_sizes(base: nn.Module, num_parts: int, owner: nn.Module) -> list[int]:
    """The output rows of each part of a fused linear."""
    if num_parts == 1:
        return [base.out_features]
    if num_parts == 3:  # q, k, v
        q = owner.num_heads * owner.head_dim
        kv = owner.num_kv_heads * owner.head_dim
        return [q, kv, kv]
    return [base.out_features // 2] * 2  # gate, up


def load_slot(wrapped: list[dict[str, LoRALinear]], slot: int, weights: LoRAWeights) -> None:
    """Copy an adapter into `slot` of every wrapped linear (zeros where the adapter leaves a module alone)."""
    for i, layer in enumerate(wrapped):
        for fused, parts in FUSED_PARTS.items():
            layer[fused].set_slot(slot, [weights.modules.get((i, part)) for part in parts])
