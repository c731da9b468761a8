"""How hard the randomized tests push: the hypothesis profile (`quick` by default, `deep` for `make test-deep`)
picks each test's example count; an environment variable still overrides one count for a single run."""

from __future__ import annotations

import os

from hypothesis import settings

QUICK, DEEP = "quick", "deep"
PROFILE_ENV = "SLUICE_HYPOTHESIS_PROFILE"  # the same as `pytest --hypothesis-profile=...`


def register() -> None:
    """Register both profiles and load the one SLUICE_HYPOTHESIS_PROFILE names (`--hypothesis-profile` wins)."""
    settings.register_profile(QUICK, deadline=None, print_blob=True)
    settings.register_profile(DEEP, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get(PROFILE_ENV, QUICK))


def is_deep() -> bool:
    return settings.get_current_profile_name() == DEEP


def examples(quick: int, deep: int, env: str | None = None) -> int:
    """`quick` under the default profile, `deep` under the deep one; the variable `env`, when set, wins."""
    return int(pick(quick, deep, env))


def pick(quick: float, deep: float, env: str | None = None) -> float:
    """Any figure that scales a test's effort (a count, a duration): as examples(), without rounding to int."""
    if env and os.environ.get(env):
        return float(os.environ[env])
    return deep if is_deep() else quick
