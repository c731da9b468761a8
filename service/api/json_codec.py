"""JSON in and out of the API: orjson where it is installed (the product's dependency, several times faster on
the streaming path), the standard library where it is not (a bare GPU image with torch, transformers, aiohttp,
uvloop and prometheus-client alone), with orjson's rules kept: no NaN or Infinity in, non-finite floats out as
null, nesting bounded by the caller's depth check."""

from __future__ import annotations

import json
import math

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by tests/api/test_bare_image.py in a subprocess
    orjson = None

MAX_DEPTH = 1024  # orjson's own limit; the standard parser recurses, so it is checked before recursing that deep


class JSONDecodeError(ValueError):
    """A body that is not JSON; its text says "depth limit" when it nests too deeply."""


def loads(raw: bytes | str):
    """The JSON value of `raw`; JSONDecodeError otherwise."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise JSONDecodeError(str(e)) from None
    if _nesting(raw) > MAX_DEPTH:
        raise JSONDecodeError("exceeds depth limit")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise JSONDecodeError(str(e)) from None


def dumps(value) -> bytes:
    """Compact UTF-8 JSON; numpy arrays as lists, non-finite floats as null (as orjson writes them)."""
    if orjson is not None:
        return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_tolist)
    except ValueError:  # a NaN or an infinity somewhere: written as null
        text = json.dumps(_finite(value), separators=(",", ":"), ensure_ascii=False, default=_tolist)
    return text.encode("utf-8", "surrogatepass")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _tolist(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return _finite(_tolist(value)) if hasattr(value, "tolist") else value


def _nesting(raw: bytes | str) -> int:
    """The deepest bracket nesting outside strings (an upper bound on the parser's recursion)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest
