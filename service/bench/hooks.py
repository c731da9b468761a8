"""Temporary wrappers around engine methods, so benches can time and observe the engine without editing it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def patched(owner, name: str, make_wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace `owner.name` (instance, class or module attribute) by make_wrapper(original), then restore it."""
    had_own = name in getattr(owner, "__dict__", {})
    original = getattr(owner, name)
    setattr(owner, name, make_wrapper(original))
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:  # it came from the class: dropping the instance attribute restores it
            delattr(owner, name)


class Timers:
    """Accumulates wall time per name; `wrap(name)` makes a wrapper factory for `patched`."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self._sync = sync  # CUDA: synchronise so async kernels are charged to the phase that launched them

    def wrap(self, name: str) -> Callable[[Callable], Callable]:
        """A wrapper factory that adds each call's duration to totals[name]."""
        totals, calls, sync = self.totals, self.calls, self._sync

        def make(fn: Callable) -> Callable:
            def timed(*args, **kwargs):
                if sync:
                    sync()
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if sync:
                        sync()
                    totals[name] += time.perf_counter() - start
                    calls[name] += 1

            return timed

        return make

    def take(self) -> dict[str, float]:
        """The totals so far, then reset."""
        snapshot = dict(self.totals)
        self.totals.clear()
        self.calls.clear()
        return snapshot


@contextmanager
def all_patched(patches: list[tuple[object, str, Callable[[Callable], Callable]]]) -> Iterator[None]:
    """Apply several `patched` at once; attributes that do not exist are skipped (engine code may move on)."""
    with ExitStack() as stack:
        for owner, name, make in patches:
            if owner is not None and hasattr(owner, name):
                stack.enter_context(patched(owner, name, make))
        yield
