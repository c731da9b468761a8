"""`sluice bench`: serving load generator, offline engine benchmark with transformers baselines, profiles.

`add_bench_subcommands(subparsers)` plugs `bench serve`, `bench offline` and `bench scheduler` into the
`sluice` command; every subcommand's `func(args)` returns the exit code.
"""

from sluice.service.bench.cli import add_bench_subcommands

__all__ = ["add_bench_subcommands"]
