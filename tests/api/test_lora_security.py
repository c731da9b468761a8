"""Runtime LoRA adapters as an attacker meets them, through `sluice serve` (issue 53): loading is the operator's
choice and confined to --lora-dir, the operator's adapters stay served, runtime loads are capped apart from them,
names are validated, and no refusal or listing quotes the files or a server path."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import pytest

from tests.support.lora import call as lora_call
from tests.support.lora import make_adapter
from tests.support.server import MODEL, Server

pytestmark = pytest.mark.timeout(300)
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
SECRET_TARGET, SECRET_TENSOR = "SECRET_VALUE_123", "SECRET_TENSOR_789"


@pytest.fixture(scope="module")
def tree(model_dir, tmp_path_factory) -> dict[str, Path]:
    """The operator's adapter outside the adapter directory, and inside it: good adapters, booby-trapped ones,
    and links that lead out."""
    base = tmp_path_factory.mktemp("lora-security")
    operator, root = base / "operator", base / "root"
    root.mkdir()
    make_adapter(model_dir, str(operator / "opA"), seed=1, targets=["q_proj", "v_proj"], r=4)
    make_adapter(model_dir, str(root / "good"), seed=2, targets=["q_proj", "v_proj"], r=4)
    for copy in ("good2", "good3"):
        shutil.copytree(root / "good", root / copy)
    config = json.loads((root / "good" / "adapter_config.json").read_text())
    # adapter_config.json naming a module that holds a secret
    shutil.copytree(root / "good", root / "secret_targets")
    (root / "secret_targets" / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": [SECRET_TARGET]}))
    # a safetensors file whose one tensor's name is a secret
    shutil.copytree(root / "good", root / "secret_tensor")
    header = json.dumps({SECRET_TENSOR: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (root / "secret_tensor" / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 4)
    # an adapter_config.json that is not JSON
    shutil.copytree(root / "good", root / "secret_json")
    (root / "secret_json" / "adapter_config.json").write_text('{"r": 4, "SECRET_JSON_456": ')
    # links out: the directory itself, and a real directory whose files point out
    (root / "escape").symlink_to(operator / "opA", target_is_directory=True)
    (root / "inner").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "inner" / name).symlink_to(operator / "opA" / name)
    return {"base": base, "root": root, "opA": operator / "opA"}


@pytest.fixture(scope="module")
def servers(model_dir, tree, tmp_path_factory):
    """(off, on): the same operator adapter; `off` without the opt-in (vLLM's switch at 0), `on` opted in through
    vLLM's switch (any case) with --lora-dir and two runtime adapters at most. Started together."""
    logs = tmp_path_factory.mktemp("lora-security-logs")
    common = ("--api-key", KEY, "--num-kv-blocks", "64", "--lora-modules", f"opA={tree['opA']}")
    off = Server(model_dir, logs, *common, env={ENV: "0"}, name="lora-off")
    on = Server(model_dir, logs, *common, "--lora-dir", str(tree["root"]), "--max-runtime-loras", "2",
                env={ENV: "True"}, name="lora-on")
    try:
        off.wait_ready()
        on.wait_ready()
        yield off, on
    finally:
        codes = (off.stop(), on.stop())
    assert codes == (0, 0), on.log()[-3000:]


def call(srv, path: str, body=None) -> tuple[int, str]:
    """(status, body text) of a GET (body None) or a JSON POST, with the key."""
    return lora_call(srv, path, body, AUTH)


def load(srv, name: str, path: str) -> tuple[int, str]:
    return call(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload(srv, name: str) -> tuple[int, str]:
    return call(srv, "/v1/unload_lora_adapter", {"lora_name": name})


def error(text: str) -> dict:
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def served(srv, model: str) -> int:
    """The status of a short completion with `model`."""
    return call(srv, "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})[0]


def test_runtime_loading_is_off_unless_the_operator_turns_it_on(servers, tree):
    off, _ = servers
    status, text = load(off, "b", str(tree["root"] / "good"))
    assert status == 404 and error(text)["code"] == "runtime_lora_disabled"
    assert "--allow-runtime-lora" in error(text)["message"]
    status, text = unload(off, "opA")
    assert status == 404 and error(text)["code"] == "runtime_lora_disabled"
    assert served(off, "opA") == 200 and served(off, "b") == 404


@pytest.mark.parametrize("where", ["absolute", "dotdot", "dotdot-absolute", "symlink", "files-linked-out", "etc",
                                   "nul"])
def test_loads_outside_the_lora_dir_are_refused_without_naming_a_path(servers, tree, where):
    _, on = servers
    root, opa = tree["root"], tree["opA"]
    path = {"absolute": str(opa), "dotdot": "../operator/opA", "dotdot-absolute": f"{root}/good/../../operator/opA",
            "symlink": "escape", "files-linked-out": str(root / "inner"), "etc": "/etc", "nul": "good\0x"}[where]
    status, text = load(on, "stolen", path)
    err = error(text)
    assert (status, err["param"], err["code"]) == (400, "lora_path", "lora_path_not_allowed"), text
    assert str(tree["base"]) not in text and "operator" not in text
    assert served(on, "stolen") == 404


def test_a_relative_lora_path_is_taken_from_the_lora_dir(servers, tree):
    _, on = servers
    try:
        assert load(on, "rel", "good")[0] == 200
        assert served(on, "rel") == 200
    finally:
        assert unload(on, "rel")[0] == 200


def test_the_operators_adapters_cannot_be_unloaded_nor_shadowed(servers, tree):
    _, on = servers
    status, text = unload(on, "opA")
    err = error(text)
    assert (status, err["param"], err["code"]) == (403, "lora_name", "lora_not_removable"), text
    status, text = load(on, "opA", "good")
    assert (status, error(text)["code"]) == (400, "lora_name_taken")
    assert served(on, "opA") == 200
    cards = {c["id"] for c in json.loads(call(on, "/v1/models")[1])["data"]}
    assert cards == {MODEL, "opA"}


def test_many_names_cannot_fill_the_registry_nor_block_the_operator(servers, tree):
    _, on = servers
    try:
        assert load(on, "r1", "good")[0] == 200
        for alias in ("r1b", "r1c"):  # the same directory under another name
            status, text = load(on, alias, str(tree["root"] / "good"))
            assert (status, error(text)["param"], error(text)["code"]) == (400, "lora_path", "lora_already_loaded")
        assert load(on, "r2", "good2")[0] == 200
        status, text = load(on, "r3", "good3")
        err = error(text)
        assert (status, err["code"]) == (400, "too_many_runtime_loras") and "--max-runtime-loras" in err["message"]
        assert served(on, "opA") == 200 and served(on, "r1") == 200
        assert unload(on, "r1")[0] == 200  # the clients' own adapters can go
        assert load(on, "r3", "good3")[0] == 200
        assert served(on, "opA") == 200 and served(on, "r1") == 404
    finally:
        for name in ("r1", "r2", "r3"):
            unload(on, name)


@pytest.mark.parametrize("name", ["x,opA", "a b", "../x", "x" * 65, "é", MODEL])
def test_adapter_names_are_validated(servers, name):
    _, on = servers
    status, text = load(on, name, "good")
    err = error(text)
    assert (status, err["param"], err["code"]) == (400, "lora_name", "invalid_lora_name"), text
    assert "opA" not in err["message"]
    assert served(on, "opA") == 200


@pytest.mark.parametrize("adapter, secret, logged", [
    ("secret_targets", SECRET_TARGET, True), ("secret_tensor", SECRET_TENSOR, True),
    ("secret_json", "SECRET_JSON_456", False), ("missing", "missing", True)])
def test_refusals_quote_no_file_contents_nor_paths(servers, tree, adapter, secret, logged):
    _, on = servers
    status, text = load(on, "probe", adapter)
    err = error(text)
    assert (status, err["param"], err["code"]) == (400, "lora_path", "invalid_lora_adapter"), text
    assert secret not in text and str(tree["base"]) not in text and adapter not in text
    assert not logged or secret in on.log()  # the log says more, under the adapter's name
    assert served(on, "probe") == 404


def test_models_lists_adapters_by_name_never_by_path(servers, tree, model_dir):
    _, on = servers
    try:
        assert load(on, "listed", "good")[0] == 200
        status, text = call(on, "/v1/models")
        assert status == 200 and str(tree["base"]) not in text and str(model_dir) not in text
        cards = {c["id"]: c for c in json.loads(text)["data"]}
        assert {name: (c["root"], c["parent"]) for name, c in cards.items()} == {
            MODEL: (MODEL, None), "opA": ("opA", MODEL), "listed": ("listed", MODEL)}
    finally:
        assert unload(on, "listed")[0] == 200


# ---- the operator's side: flags, vLLM's switch, start-up refusals (no server) -----------------------------

def serve_refusal(capsys, monkeypatch, *flags: str, env: str | None = None) -> str:
    """What `sluice serve` prints refusing `flags` at start-up (it must exit 2 before loading anything)."""
    from sluice.service.cli import main

    monkeypatch.delenv(ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(ENV, env)
    assert main(["serve", "--model", "nowhere", *flags]) == 2
    return capsys.readouterr().err


def test_the_opt_in_needs_a_lora_dir_and_names_are_checked_at_start_up(capsys, monkeypatch, tmp_path):
    assert "needs --lora-dir DIR" in serve_refusal(capsys, monkeypatch, "--allow-runtime-lora")
    assert "needs --lora-dir DIR" in serve_refusal(capsys, monkeypatch, "--enable-lora", env="TRUE")
    assert "is not a directory" in serve_refusal(capsys, monkeypatch, "--allow-runtime-lora", "--lora-dir",
                                                 str(tmp_path / "nowhere"))
    err = serve_refusal(capsys, monkeypatch, "--lora-modules", f"x,opA={tmp_path}")
    assert "--lora-modules 'x,opA'" in err and "letters, digits" in err
    assert "twice" in serve_refusal(capsys, monkeypatch, "--lora-modules", f"a={tmp_path}", f"a={tmp_path}")


def test_vllms_switch_turns_runtime_loading_on_only_where_lora_is_on(monkeypatch):
    from sluice.service.config import LoRAConfig

    for value, on in (("1", True), ("true", True), (" TRUE ", True), ("0", False), ("false", False),
                      ("yes", False), ("", False)):
        monkeypatch.setenv(ENV, value)
        assert LoRAConfig(enable_lora=True).runtime_loading is on, value
        assert not LoRAConfig().runtime_loading  # LoRA off: the switch alone turns nothing on
    monkeypatch.delenv(ENV)
    assert not LoRAConfig(lora_modules=("a=/x",)).runtime_loading  # --lora-modules alone: no runtime loads
    assert LoRAConfig(allow_runtime_lora=True).runtime_loading and LoRAConfig(allow_runtime_lora=True).enabled


def test_help_shows_the_lora_dir_next_to_the_opt_in():
    from sluice.service.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    flags = [a.option_strings[0] for a in serve._actions if a.option_strings]
    at = flags.index("--allow-runtime-lora")
    assert flags[at + 1] == "--lora-dir"
    assert ENV in " ".join(serve.format_help().split())  # the help names vLLM's switch
