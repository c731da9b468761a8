"""`sluice` with injected engine faults, for tests only: `python -m tests.support.fault_serve SPEC serve [flags]`.

SPEC is a tests/support/faults.py spec (`token:<id>`, `step:<n>`, comma-separated). Every LLMEngine this process builds
gets it; then the real `sluice` command line runs with the remaining arguments. `Server(..., faults=SPEC)`
(tests/support/server.py) calls install_on_every_engine in its forked server the same way.
"""

from __future__ import annotations

import sys

from sluice.service.cli import main
from sluice.service.engine.engine import LLMEngine
from tests.support.faults import FaultHook, install


def install_on_every_engine(spec: str) -> None:
    """Patch LLMEngine so that each engine built from now on fails the steps `spec` names."""
    FaultHook(spec)  # a bad spec fails here, before any model loads
    init = LLMEngine.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        install(self, spec)

    LLMEngine.__init__ = __init__


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m tests.support.fault_serve SPEC serve [flags]")
    install_on_every_engine(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
