"""The structured-output parameters clients send, reduced to one StructuredOutput constraint.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` ({json | regex | choice |
grammar}) and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` spellings.
"""

from __future__ import annotations

from sluice.scheduling.sampling_params import StructuredOutput
from sluice.service.api import json_codec
from sluice.service.api.errors import ApiErrorCode, RequestError

MAX_SPEC_BYTES = 64 * 1024  # a schema, grammar or choice list larger than this is almost surely a mistake
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays; real schemas stay under 20, serializers recurse past ~250
# Keywords xgrammar (0.2.9) compiles as if absent: a schema using them would not constrain what it says.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
                        "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def parse_structured_output(body: dict) -> StructuredOutput | None:
    """The request's output constraint, or None; RequestError naming the parameter when it is malformed."""
    found = [c for c in (_response_format(body), _structured_outputs(body), _guided(body)) if c is not None]
    if len(found) > 1:
        raise RequestError("give at most one of response_format, structured_outputs and guided_*",
                           found[1].param.split(".")[0])
    return found[0] if found else None


def _response_format(body: dict) -> StructuredOutput | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError("'response_format' must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("'response_format.json_schema' must be an object", "response_format.json_schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError("'response_format.json_schema.name' must be a string",
                               "response_format.json_schema.name")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: a missing schema allows any object
        return _json(schema, "response_format.json_schema.schema")
    raise RequestError("'response_format.type' must be one of text, json_object, json_schema",
                       "response_format.type")


def _structured_outputs(body: dict) -> StructuredOutput | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise RequestError("'structured_outputs' must be an object", "structured_outputs")
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise RequestError("'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object",
                           "structured_outputs")
    key = given[0]
    return _constraint(key, so[key], f"structured_outputs.{key}")


def _guided(body: dict) -> StructuredOutput | None:
    given = [k for k in _GUIDED if body.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give only one of {', '.join(_GUIDED)}", given[1])
    return _constraint(_GUIDED[given[0]], body[given[0]], given[0])


def _constraint(kind: str, value, param: str) -> StructuredOutput:
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    if kind == "json":
        return _json(value, param)
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise RequestError(f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings", param)
        text = json_codec.dumps(value).decode()
        _check_size(text, param)
        return StructuredOutput("choice", text, param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{param}' must be a non-empty string", param)
    _check_size(value, param)
    return StructuredOutput(kind, value, param)


def _json(schema, param: str) -> StructuredOutput:
    """A JSON schema given as an object or as its JSON text; stored as compact text (the cache key).

    Keys keep the client's order: the grammar emits properties in schema order, which clients rely on.
    """
    if isinstance(schema, str):
        try:
            schema = json_codec.loads(schema)
        except json_codec.JSONDecodeError:
            raise RequestError(f"'{param}' is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"'{param}' must be a JSON schema object", param)
    check_schema_shape(schema, param, keywords=True)
    text = json_codec.dumps(schema).decode()
    _check_size(text, param)
    return StructuredOutput("json", text, param)


def _check_size(text: str, param: str) -> None:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise RequestError(f"'{param}' is larger than {MAX_SPEC_BYTES} bytes", param)


def check_schema_shape(schema, param: str, keywords: bool) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH, and (`keywords`) one using a keyword the grammar
    would ignore or a `$ref` that is not a local `#...` pointer; iterative, so any depth is safe to walk."""
    pending = [(schema, 1, keywords)]  # (node, depth, whether a dict here is a schema whose keys are keywords)
    while pending:
        node, depth, is_schema = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"'{param}' is nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
        if isinstance(node, list):
            pending.extend((v, depth + 1, is_schema) for v in node if isinstance(v, (dict, list)))
        elif isinstance(node, dict):
            if is_schema:
                _check_keywords(node, param)
            for key, value in node.items():
                if not isinstance(value, (dict, list)):
                    continue
                if is_schema and key in _NAMED_SCHEMAS and isinstance(value, dict):  # keys are names
                    pending.extend((v, depth + 2, True) for v in value.values() if isinstance(v, (dict, list)))
                else:
                    pending.append((value, depth + 1, is_schema and key not in _DATA))


_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_DATA = ("enum", "const", "default", "examples")
_UNSUPPORTED = ApiErrorCode.UNSUPPORTED_SCHEMA_KEYWORD


def _check_keywords(node: dict, param: str) -> None:
    for key in UNSUPPORTED_KEYWORDS:
        if key in node:
            raise RequestError(f"'{param}' uses '{key}', which structured outputs do not support (the output "
                               "would not be constrained by it)", param, code=_UNSUPPORTED)
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise RequestError(f"'{param}' has $ref {ref[:80]!r}: only local references ('#/...') are supported",
                           param, code=_UNSUPPORTED)
    if node.get("uniqueItems") is True:
        raise RequestError(f"'{param}' uses 'uniqueItems', which structured outputs do not support", param,
                           code=_UNSUPPORTED)
    for key in ("unevaluatedProperties", "unevaluatedItems"):
        if key in node and node[key] is not False:
            raise RequestError(f"'{param}' uses '{key}' with a schema; only false is supported", param,
                               code=_UNSUPPORTED)
