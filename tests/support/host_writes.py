"""A dispatch mode that records the host-to-device writes a CUDA step must not make, visible on any device.

On CUDA, `x[index_tensors] = 0.5` builds the 0.5 as a CPU tensor and index_put_ copies it to the device, a
blocking copy (a host sync that `torch.cuda.set_sync_debug_mode("error")` refuses); `x[i, j] = 0.5` copies it
into a one-element slice; `torch.tensor(data, device=...)` copies its host data with a blocking copy. Run on the
meta device, those show up as an index_put whose value is 0-dim, a copy_ between 0-dim tensors, a tensor
lifted from Python data straight onto the device, and a non-CPU `_to_copy` of a CPU tensor that is not
non_blocking. A write through masked_fill_/index_fill_ (the value a kernel argument) or a pinned non-blocking
copy (kvcache/transfer.to_device) is none of these.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostWrites(TorchDispatchMode):
    """Records (op, why) for every write of host data into a device tensor that would block on CUDA."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("index_put_", "index_put", "_index_put_impl_") and args[2].dim() == 0:
            self.found.append(f"{func}: a Python scalar put through tensor indices")
        elif name == "copy_" and args[0].dim() == 0 and args[1].dim() == 0:
            self.found.append(f"{func}: a Python scalar copied into one element")
        elif name == "lift_fresh" and args[0].device.type != "cpu":
            self.found.append(f"{func}: torch.tensor(data, device=...) copies host data with a blocking copy")
        elif (name == "_to_copy" and args[0].device.type == "cpu" and kwargs.get("device") is not None
              and torch.device(kwargs["device"]).type != "cpu" and not kwargs.get("non_blocking")):
            self.found.append(f"{func}: a blocking host-to-device copy")
        return func(*args, **kwargs)
