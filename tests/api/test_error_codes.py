"""Error codes end to end: every RequestError carries an ErrorCode or ApiErrorCode, which alone decides its status,
type and the `code` clients see; the codes the engine names as text are all members."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from sluice.scheduling.outcomes import CodedEnum, ErrorCode
from sluice.service.api.errors import ApiErrorCode, RequestError, code_named, context_length_error
from sluice.service.executor.lora.adapter import LoRAError
from sluice.service.structured import grammar_checks

SERVICE = Path(__file__).resolve().parents[2] / "service"
BELOW_THE_API = ("structured", "executor", "engine")  # the rooms whose errors name their codes as text
ALL_CODES = [*ErrorCode, *ApiErrorCode]


def _calls(root: Path | tuple[Path, ...], name: str):
    """(file, call) for every call of `name` under `root` (or each of several roots)."""
    for path in sorted(p for r in (root if isinstance(root, tuple) else (root,)) for p in r.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                yield path.relative_to(SERVICE.parent), node


def test_a_str_code_is_refused_at_construction():
    with pytest.raises(TypeError, match="ErrorCode"):
        RequestError("m", "model", "model_not_found")
    with pytest.raises(TypeError):
        RequestError("m", code="context_length_exceeded")
    with pytest.raises(TypeError):
        RequestError("m", code=None)


@pytest.mark.parametrize("code", ALL_CODES, ids=str)
def test_status_type_and_wire_code_come_from_the_code(code: CodedEnum):
    e = RequestError("m", "p", code)
    assert (e.status, e.type, e.code) == (code.status, code.type, code)
    assert e.to_dict() == {"error": {"message": "m", "type": code.type, "param": "p",
                                     "code": code.value if code.named else None}}
    assert type(e.to_dict()["error"]["code"]) in (str, type(None))  # plain text on the wire, not the member


def test_a_bad_parameter_is_a_400_with_openais_null_code():
    e = RequestError("'n' must be at least 1", "n")
    assert (e.status, e.type, e.code) == (400, "invalid_request_error", ApiErrorCode.INVALID_REQUEST)
    assert e.to_dict()["error"]["code"] is None
    e = context_length_error(8, "you asked for more.", "prompt")
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "prompt")
    assert e.message == "This model's maximum context length is 8 tokens. However, you asked for more."


def test_the_two_enums_never_share_a_value():
    assert not {c.value for c in ErrorCode} & {c.value for c in ApiErrorCode}
    assert all(code_named(c.value) is c for c in ALL_CODES)
    assert code_named(None) is ApiErrorCode.INVALID_REQUEST
    with pytest.raises(ValueError):
        code_named("no_such_code")


def test_no_raise_writes_a_status_type_or_code_by_hand():
    """The type check catches what runs; this catches what no test reaches."""
    bad = []
    for path, call in _calls(SERVICE, "RequestError"):
        literal_code = [a for a in call.args[2:3] if isinstance(a, ast.Constant)]
        literal_code += [k for k in call.keywords if k.arg == "code" and isinstance(k.value, ast.Constant)]
        if literal_code or any(k.arg in ("status", "type") for k in call.keywords) or len(call.args) > 4:
            bad.append(f"{path}:{call.lineno}")
    assert not bad, bad


def test_every_code_the_engine_names_is_a_member_with_its_status():
    """LoRAError (service/executor/lora) and GrammarError (service/structured, service/engine/constrained.py) name
    codes as text; the API turns them into members, whose status then decides the answer: it must be the one the
    engine meant."""
    lora_defaults = inspect.signature(LoRAError).parameters
    seen = set()
    below = tuple(SERVICE / room for room in BELOW_THE_API)
    for path, call in _calls(below, "LoRAError"):
        kw = {k.arg: k.value for k in call.keywords}
        code = kw["code"].value if "code" in kw else lora_defaults["code"].default
        status = kw["status"].value if "status" in kw else lora_defaults["status"].default
        assert code_named(code).status == status, (path, call.lineno, code)
        seen.add(code)
    assert {"runtime_lora_disabled", "lora_not_removable", "invalid_lora_adapter"} <= seen
    grammar = {grammar_checks.TOO_COMPLEX}
    for _, call in _calls(below, "GrammarError"):
        args = [*call.args[2:3], *(k.value for k in call.keywords if k.arg == "code")]
        grammar.update(a.value for a in args if isinstance(a, ast.Constant))
    assert "grammar_unavailable" in grammar
    assert all(code_named(c).status == 400 for c in grammar)
