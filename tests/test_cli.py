"""`sluice serve` flags: one per config field, each also an environment variable, all documented."""

from __future__ import annotations

import dataclasses
import os

import pytest

from sluice.service.cli import build_parser
from sluice.service.config import SluiceConfig, config_from_args


@pytest.fixture(autouse=True)
def no_sluice_environment(monkeypatch):
    """Flags fall back to SLUICE_* variables: the caller's own (SLUICE_CACHE_DIR, say) must not leak in."""
    for name in [n for n in os.environ if n.startswith("SLUICE_")]:
        monkeypatch.delenv(name)


def config(argv: list[str]) -> SluiceConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_match_the_dataclasses():
    assert config([]) == SluiceConfig()


def test_flags(monkeypatch):
    c = config(["--model", "/m", "--port", "9000", "--no-prefix-caching", "--scheduling-policy", "priority",
                "--kv-cache-memory", "0.5", "--api-key", "k", "--shutdown-timeout", "3"])
    assert (c.model.model, c.server.port, c.cache.enable_prefix_caching, c.scheduler.scheduling_policy) == (
        "/m", 9000, False, "priority")
    assert (c.cache.kv_cache_memory, c.server.api_key, c.server.shutdown_timeout) == (0.5, "k", 3.0)


def test_environment_sets_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("SLUICE_PORT", "1234")
    monkeypatch.setenv("SLUICE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("SLUICE_PREEMPTION_MODE", "swap")
    c = config([])
    assert c.server.port == 1234 and not c.cache.enable_prefix_caching and c.scheduler.preemption_mode == "swap"
    assert config(["--port", "5"]).server.port == 5


@pytest.mark.parametrize("env,value", [("SLUICE_PORT", "eighty"), ("SLUICE_ENABLE_PREFIX_CACHING", "maybe")])
def test_bad_environment_values_are_rejected(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit):
        build_parser()


def test_bad_choice_is_rejected():
    with pytest.raises(SystemExit):
        config(["--scheduling-policy", "random"])


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for section in dataclasses.fields(SluiceConfig):
        for f in dataclasses.fields(section.default_factory):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            assert flag in text and f"SLUICE_{f.name.upper()}" in text, f.name
    assert "(default: 8000)" in text
