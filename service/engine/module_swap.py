"""Swapping a model's modules for ones with leaner forwards, and the check that decides which qualify: a class whose
code is, source for source, transformers' own (fused_norm, lean_layers)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn


@functools.cache
def same_source(a, b) -> bool:
    """Whether two functions' source texts are identical (False where either has none to read)."""
    try:
        return inspect.getsource(a) == inspect.getsource(b)
    except (OSError, TypeError):
        return False


def swap_modules(model: nn.Module, qualifies: Callable[[nn.Module], bool],
                 make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule of `model` for which qualifies(module) holds by make(module), in place; returns how
    many. All are found before any is replaced, so a replacement is never itself visited."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if qualifies(child)]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
