"""Generate the reference parts of docs/ from the code, so the docs cannot drift from it.

    python -m sluice.service.bench.gen_docs           # rewrite the generated sections of docs/*.md
    python -m sluice.service.bench.gen_docs --check   # exit 1 when a committed section is stale

A generated section sits between `<!-- generated: NAME ... -->` and `<!-- end generated: NAME -->`; the text
around it is written by hand. The endpoints come from the app's router, the request fields from the OpenAPI
document the server answers at /openapi.json, the flags from the config dataclasses' `knob` metadata (the same
fields `sluice serve` turns into flags and environment variables).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from sluice.service.config import ENV_PREFIX, SluiceConfig, add_config_flags

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMAND = "python -m sluice.service.bench.gen_docs"


# ---- markdown helpers

def _cell(text: object) -> str:
    """Text that stays inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: object) -> str:
    return f"`{value}`" if value not in ("", None) else ""


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the API: endpoints and request fields

def _openapi() -> dict:
    from sluice.service.api.openapi import openapi_spec

    return openapi_spec("docs")


def _resolve(schema: dict, spec: dict) -> dict:
    """Follow a local `$ref` (pydantic-generated documents use them; the hand-written one does not)."""
    while "$ref" in schema:
        target: object = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]  # type: ignore[index]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}  # type: ignore[dict-item]
    return schema


def _alternatives(schema: dict, spec: dict) -> tuple[list[dict], bool]:
    """The non-null alternatives of a schema, and whether null is allowed."""
    schema = _resolve(schema, spec)
    options = schema.get("oneOf") or schema.get("anyOf")
    if not options:
        kind = schema.get("type")
        if isinstance(kind, list):  # OpenAPI 3.1: ["string", "null"]
            rest = [k for k in kind if k != "null"]
            return [{**schema, "type": rest[0] if len(rest) == 1 else rest}], "null" in kind
        return [schema], bool(schema.get("nullable"))
    nullable = bool(schema.get("nullable"))
    kept = []
    for option in options:
        inner, null = _alternatives(option, spec)
        nullable |= null or _resolve(option, spec).get("type") == "null"
        kept += [o for o in inner if o.get("type") != "null"]
    return kept, nullable


def _type(schema: dict, spec: dict) -> str:
    """A short type description: `string`, `array of integer`, `object {name, schema}`, `"a" | "b"`."""
    options, _ = _alternatives(schema, spec)
    names = []
    for s in options:
        if "enum" in s:
            names.append(" | ".join(json.dumps(v) for v in s["enum"] if v is not None) or "null")
        elif s.get("type") == "array":
            names.append("array of " + _type(s.get("items", {}), spec))
        elif s.get("type") == "object" and s.get("properties"):
            names.append("object {" + ", ".join(s["properties"]) + "}")
        else:
            names.append(str(s.get("type", "any")))
    return " or ".join(dict.fromkeys(names)) or "any"


_LIMITS = (("minimum", ">= {}"), ("maximum", "<= {}"), ("minLength", "length >= {}"),
           ("maxLength", "length <= {}"), ("minItems", ">= {} items"), ("maxItems", "<= {} items"),
           ("maxProperties", "<= {} keys"), ("pattern", "matches `{}`"))


def _limits(schema: dict, spec: dict) -> str:
    """The bounds a field's schema states (over all its alternatives)."""
    found: list[str] = []
    for s in _alternatives(schema, spec)[0]:
        for key, text in _LIMITS:
            if key in s:
                found.append(text.format(s[key]))
        exclusive = s.get("exclusiveMinimum")
        if exclusive is True:  # OpenAPI 3.0: a flag on minimum
            found = [f"> {s['minimum']}" if f == f">= {s['minimum']}" else f for f in found]
        elif isinstance(exclusive, (int, float)) and not isinstance(exclusive, bool):
            found.append(f"> {exclusive}")
    return ", ".join(dict.fromkeys(found))


def request_fields(path: str, spec: dict | None = None) -> str:
    """The table of every field the request body of `path` takes, as the OpenAPI document states it."""
    spec = spec or _openapi()
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = _resolve(body, spec)
    required = set(body.get("required", []))
    rows = []
    for name, schema in body["properties"].items():
        resolved = _resolve(schema, spec)
        default = json.dumps(resolved["default"]) if "default" in resolved else ""
        rows.append([f"`{name}`" + (" (required)" if name in required else ""), _type(schema, spec),
                     _code(default), _limits(schema, spec), resolved.get("description", "")])
    return _table(["field", "type", "default", "limits", "meaning"], rows)


def endpoints() -> str:
    """Every route the app serves: method, path and what it does (OpenAPI's summary, else the handler's doc)."""
    from sluice.service.api.api_server import create_app

    spec = _openapi()
    rows = []
    for route in create_app(SluiceConfig()).router.routes():
        if route.method == "HEAD":  # aiohttp adds one beside every GET
            continue
        path = route.resource.canonical
        summary = spec["paths"].get(path, {}).get(route.method.lower(), {}).get("summary")
        doc = summary or (route.handler.__doc__ or "").strip().splitlines()[0]
        rows.append([route.method, f"`{path}`", doc])
    return _table(["method", "path", "what it does"], rows)


# ---- operations: every flag of `sluice serve`

def _default(field: dataclasses.Field) -> str:
    value = field.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)) and not value:
        return "(none)"
    return _code(value) or "(empty)"


def flags() -> str:
    """One table per config section: flag, environment variable, default and help, from the knob metadata."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    option = {a.dest: a.option_strings for a in parser._actions}
    out = []
    for section in dataclasses.fields(SluiceConfig):
        cls = section.default_factory  # type: ignore[misc]
        out.append(f"### {section.name}\n\n{(cls.__doc__ or '').strip().splitlines()[0]}\n")
        rows = []
        for f in dataclasses.fields(cls):
            names = " / ".join(f"`{o}`" for o in option[f"{section.name}__{f.name}"])
            choices = f.metadata.get("choices")
            meaning = f.metadata["help"] + (f" One of: {', '.join(choices)}." if choices else "")
            rows.append([names, f"`{ENV_PREFIX}{f.name.upper()}`", _default(f), meaning])
        out.append(_table(["flag", "environment", "default", "meaning"], rows) + "\n")
    return "\n".join(out).rstrip()


# ---- the sections and their files

SECTIONS: dict[tuple[str, str], Callable[[], str]] = {
    ("api.md", "endpoints"): endpoints,
    ("api.md", "completions-fields"): lambda: request_fields("/v1/completions"),
    ("api.md", "chat-fields"): lambda: request_fields("/v1/chat/completions"),
    ("api.md", "embeddings-fields"): lambda: request_fields("/v1/embeddings"),
    ("api.md", "responses-fields"): lambda: request_fields("/v1/responses"),
    ("operations.md", "flags"): flags,
}


def _marker(name: str) -> re.Pattern:
    name = re.escape(name)
    return re.compile(rf"(<!-- generated: {name} [^\n]*-->\n)(.*?)(<!-- end generated: {name} -->)", re.S)


def render(docs: Path = DOCS) -> dict[Path, str]:
    """Each docs file with its generated sections filled in from the code (KeyError: markers missing)."""
    texts: dict[Path, str] = {}
    for (name, section), make in SECTIONS.items():
        path = docs / name
        text = texts.get(path) or path.read_text()
        match = _marker(section).search(text)
        if match is None:
            raise KeyError(f"{path}: no '<!-- generated: {section} ({COMMAND}) -->' ... "
                           f"'<!-- end generated: {section} -->' markers")
        body = "\n" + make() + "\n\n"
        texts[path] = text[:match.start(2)] + body + text[match.end(2):]
    return texts


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated sections, or with --check report those that are stale."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale sections (exit 1)")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; run `{COMMAND}`", file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
