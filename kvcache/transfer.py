"""Host lists to device tensors without a host sync: the one helper attention metadata and the sampler share."""

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
