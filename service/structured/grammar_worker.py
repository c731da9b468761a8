"""The compile worker: a child process that turns constraint text into a serialized xgrammar CompiledGrammar.

xgrammar's compile is C++ that no thread can interrupt; in a child process a compile past its time limit is
ended by killing the process (grammar_compile.py). The child imports only xgrammar (and, through it, torch).
"""

from __future__ import annotations

import json

from sluice.cpu import COMPILE_NICENESS, lower_priority
from sluice.service.structured.grammar_checks import (
    TOO_COMPLEX,
    GrammarError,
    ambiguous_repeat,
    strings_without_controls,
)


def compile_constraint(xgr, compiler, kind: str, spec: str, param: str):
    """The CompiledGrammar of one constraint, checked: GrammarError when it is invalid, ambiguous or empty."""
    try:
        compiled = _compile(xgr, compiler, kind, spec, param)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar reports bad input as RuntimeError with its parser's message
        reason = str(e).split("\n")[0]
        reason = reason.split("] ", 1)[-1].split(": ", 1)[-1] if "] " in reason else reason
        raise GrammarError(f"invalid {param}: {reason}", param) from None
    _check_accepts_something(xgr, compiled, param)
    return compiled


def _compile(xgr, compiler, kind: str, spec: str, param: str):
    if kind == "json_object":  # any JSON object, with the same compact whitespace as schemas get
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json":
        try:
            json.loads(spec)
        except ValueError:
            raise GrammarError(f"invalid {param}: the schema is not valid JSON", param) from None
        # Compact separators: a small model free to emit "any whitespace" can pad a reply until max_tokens.
        grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        return compiler.compile_grammar(strings_without_controls(str(grammar)))
    if kind == "choice":
        # Raw UTF-8 in the literals: JSON's \ud83d-style escapes would be read as lone surrogate code points.
        literals = (json.dumps(x, ensure_ascii=False) for x in json.loads(spec))
        return compiler.compile_grammar("root ::= " + " | ".join(literals))
    if kind == "regex":
        grammar = xgr.Grammar.from_regex(spec)
    elif kind == "grammar":
        grammar = xgr.Grammar.from_ebnf(spec)
    else:
        raise GrammarError(f"unknown structured output kind {kind!r}", param)
    rule = ambiguous_repeat(str(grammar))
    if rule is not None:
        raise GrammarError(
            f"{param} repeats something that can match the empty string (rule {rule!r}, e.g. (x*|y*)* or a* "
            "with a ::= \"x\"*): it matches a text in unboundedly many ways; make the repeated part non-empty",
            param, TOO_COMPLEX)
    return compiler.compile_grammar(grammar)


def _check_accepts_something(xgr, compiled, param: str) -> None:
    """A grammar whose first mask allows no token (not even the end) can never produce an output."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bitmask.any():
        raise GrammarError(f"{param} accepts no text at all: no output could satisfy it", param)


def serve(conn) -> None:
    """Child process main: read the tokenizer info's JSON, then answer (kind, spec, param) with ("ok", json) or
    ("error", message, code) until EOF."""
    lower_priority(COMPILE_NICENESS)  # a compile is one request's work: the step's cores come first
    import xgrammar as xgr

    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):
        return
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the parent caches, by bytes
    conn.send(("ready",))
    while True:
        try:
            kind, spec, param = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compile_constraint(xgr, compiler, kind, spec, param)
            reply = ("ok", compiled.serialize_json())
        except GrammarError as e:
            reply = ("error", str(e), e.code)
        except Exception as e:  # never let one constraint end the worker
            reply = ("error", f"invalid {param}: {type(e).__name__}", None)
        conn.send(reply)
