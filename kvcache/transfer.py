"""Host lists and tensors to the device without a host sync: the helpers attention metadata, the sampler and the
runner share."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without a sync: through pinned memory and a non-blocking copy on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Host integer tensors flattened into one int64 tensor (what `tensors_to_device` copies)."""
    return torch.cat([t.reshape(-1).to(torch.long) for t in tensors])


def unpacked(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`packed`'s inverse: the pieces of `flat` in the shapes and dtypes of `like`."""
    pieces = flat.split([t.numel() for t in like])
    return [piece.view(t.shape).to(t.dtype) for piece, t in zip(pieces, like, strict=True)]


def tensors_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors on `device` in one non-blocking copy (one pinned buffer on CUDA): a copy from pageable
    memory would first wait for everything already queued on the GPU."""
    if device.type == "cpu":
        return tensors
    flat = packed(tensors)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return unpacked(flat.to(device, non_blocking=True), tensors)
