"""Helpers shared by the test modules (servers, tiny models, fakes, fault injection); no tests live here."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root, whichever folder a test module sits in
