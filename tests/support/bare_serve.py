"""`python -m tests.support.bare_serve serve ...`: `sluice serve` as on a bare GPU image, where only torch,
transformers, aiohttp, uvloop and prometheus-client are installed: the optional packages cannot be imported and
no ninja builds the native kernels."""

from __future__ import annotations

import sys

OPTIONAL = ("orjson", "xgrammar", "gguf", "jsonschema_rs", "ninja")


def hide_optional() -> None:
    """Make every optional package fail to import, and ninja be missing, for this process."""
    import torch.utils.cpp_extension as cpp_extension

    for name in OPTIONAL:
        sys.modules[name] = None  # `import name` now raises ImportError
    cpp_extension.is_ninja_available = lambda: False


if __name__ == "__main__":
    hide_optional()
    from sluice.service.cli import main

    raise SystemExit(main(sys.argv[1:]))
