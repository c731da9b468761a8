"""Pure checks on a grammar's text, run in the compile worker: ambiguity, and the JSON-string rewrite.

Both read xgrammar's normalized EBNF (`str(xgr.Grammar)`), where every repeat has become a right-recursive
rule `r ::= ("" | (X r))` and bounded repeats are `X{m, n}`.
"""

from __future__ import annotations

import re

TOO_COMPLEX = "grammar_too_complex"


class GrammarError(ValueError):
    """A constraint that does not compile; `param` names the API parameter it came from, `code` the kind."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


# xgrammar (0.2.9) compiles minLength/maxLength as `<rule>_characters{m, n}` over `[^"\\\r\n]`, linear in n,
# but that class lets raw control characters in (invalid JSON). Narrowing the class keeps the linear form.
_BOUNDED_CHARS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_NO_CONTROLS = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'


def strings_without_controls(ebnf: str) -> str:
    """The schema grammar with its length-bounded strings refusing control characters (and escapes, as before)."""
    return _BOUNDED_CHARS.sub(_NO_CONTROLS, ebnf)


_TOKEN = re.compile(
    r'\s+|(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<look>\(=)|(?P<call>[A-Za-z_]\w*\()'
    r'|(?P<name>[A-Za-z_][\w-]*)|(?P<rep>\{\s*\d+\s*,\s*-?\d+\s*\})|(?P<op>[()|*+?])',
    re.DOTALL,
)
_OPAQUE = ("opaque", False)  # lookaheads, Regex(...), TagDispatch(...): assumed not empty (proves nothing)


def _parse_body(body: str):
    """A rule body as nested ("alt", [("seq", [elements])]) nodes; None when the text is not understood."""
    stack: list[list] = [[[]]]  # per open group: its alternatives, each a list of elements
    pos, n = 0, len(body)
    while pos < n:
        m = _TOKEN.match(body, pos)
        if m is None:
            return None
        pos = m.end()
        kind = m.lastgroup
        alts = stack[-1]
        if kind is None:
            continue
        if kind in ("look", "call"):  # skip to the matching parenthesis, strings aside
            depth = 1
            while pos < n and depth:
                s = _TOKEN.match(body, pos)
                if s is None:
                    return None
                pos = s.end()
                tok = s.group()
                depth += (tok in ("(", "(=") or tok.endswith("(")) - (tok == ")")
            if kind == "call":
                alts[-1].append(_OPAQUE)
        elif kind == "str":
            alts[-1].append(("lit", m.group() == '""'))
        elif kind == "cls":
            alts[-1].append(("lit", False))
        elif kind == "name":
            alts[-1].append(("ref", m.group()))
        elif kind == "rep":
            if not alts[-1]:
                return None
            low, high = (int(x) for x in m.group()[1:-1].split(","))
            alts[-1][-1] = ("rep", alts[-1][-1], low, high)
        elif m.group() in "*+?":
            if not alts[-1]:
                return None
            low, high = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[m.group()]
            alts[-1][-1] = ("rep", alts[-1][-1], low, high)
        elif m.group() == "(":
            if len(stack) > 16:
                return None
            stack.append([[]])
        elif m.group() == ")":
            if len(stack) == 1:
                return None
            group = stack.pop()
            stack[-1][-1].append(("group", group))
        elif m.group() == "|":
            alts.append([])
    return stack[0] if len(stack) == 1 else None


def _nullable(node, empty: set[str]) -> bool:
    """Whether a node can match the empty string, given the rules known to (`empty`)."""
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "opaque":
        return False
    if kind == "ref":
        return node[1] in empty
    if kind == "rep":
        return node[2] == 0 or _nullable(node[1], empty)
    return any(all(_nullable(e, empty) for e in seq) for seq in node[1])  # group


def ambiguous_repeat(ebnf: str) -> str | None:
    """The name of a rule that repeats something able to match the empty string, else None.

    Such a repeat (`(x*|x*x*)*`, `a*` with `a ::= "x"*`) matches one text in unboundedly many ways, and the
    matcher's work per token grows with every token. Grammars this reader does not understand pass.
    """
    rules: dict[str, list] = {}
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            continue
        parsed = _parse_body(body)
        if parsed is None:
            return None
        rules[name.strip()] = parsed
    empty: set[str] = set()
    changed = True
    while changed:  # least fixpoint: a rule is nullable once one alternative is
        changed = False
        for name, alts in rules.items():
            if name not in empty and _nullable(("group", alts), empty):
                empty.add(name)
                changed = True
    for name, alts in rules.items():
        pending = [("group", alts)]
        while pending:
            node = pending.pop()
            if node[0] == "rep":
                if node[3] != 1 and _nullable(node[1], empty):
                    return name
                pending.append(node[1])
            elif node[0] == "group":
                for seq in node[1]:
                    # r ::= X r with X able to match nothing: the recursion can loop without reading a byte.
                    if len(seq) > 1 and seq[-1] == ("ref", name) and all(_nullable(e, empty) for e in seq[:-1]):
                        return name
                    pending.extend(seq)
    return None
