"""The docs say what the code does: generated tables match the code, every `sluice` and `make` command they show
uses flags, subcommands and targets that exist, and the shell blocks marked `<!-- runnable -->` run."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from sluice.service.bench import gen_docs
from sluice.service.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
RUNNABLE = "<!-- runnable -->"
# Flags of other programs that the docs name in backticks (the gateway's picker, cmake, docker, pip).
FOREIGN_FLAGS = {"--kv-cache-usage-percentage-metric", "--build-arg", "--no-deps"}
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")


@dataclass(slots=True)
class Block:
    """One fenced code block of a markdown file."""

    where: str
    lang: str
    text: str
    runnable: bool


def blocks(text: str, name: str = "<text>") -> list[Block]:
    """Every fenced block, with whether the line before it marks it runnable."""
    found = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(f"{name}:{line}", m.group(1).lower(), m.group(2), before == RUNNABLE))
    return found


def commands(block: Block) -> list[list[str]]:
    """The simple commands of a shell block (comments dropped, continuations joined, split at | && || ;)."""
    text = block.text.replace("\\\n", " ")
    if block.lang == "console":  # only the prompt lines are commands
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ "))
    out, pending = [], ""
    for line in text.splitlines():
        pending += line + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending, current = "", []
        for token in tokens:
            if set(token) <= set("|&;"):
                out.append(current)
                current = []
            else:
                current.append(token)
        out.append(current)
    return [c for c in out if c]


# ---- what exists: the `sluice` parser tree and the Makefile's targets

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


@cache
def sluice_parser() -> argparse.ArgumentParser:
    return build_parser()


@cache
def all_sluice_flags() -> frozenset[str]:
    """Every option of `sluice` and of all its subcommands."""
    seen, todo = set(), [sluice_parser()]
    while todo:
        parser = todo.pop()
        seen |= _options(parser)
        todo += _subparsers(parser).values()
    return frozenset(seen)


def make_targets(makefile: Path = REPO / "Makefile") -> set[str]:
    """The targets a `make X` may name: every rule of the Makefile (variables and special targets aside)."""
    rule = re.compile(r"^([A-Za-z0-9][\w.-]*(?:\s+[A-Za-z0-9][\w.-]*)*)\s*:(?!=)", re.M)
    return {t for m in rule.finditer(makefile.read_text()) for t in m.group(1).split()}


@cache
def routes() -> frozenset[str]:
    """Every path the app serves."""
    from sluice.service.api.api_server import create_app
    from sluice.service.config import SluiceConfig

    return frozenset(r.resource.canonical for r in create_app(SluiceConfig()).router.routes())


def check_curl(args: list[str]) -> list[str]:
    """Problems with one `curl` of the local server: a path the app does not serve."""
    local = re.compile(r"(?:https?://)?(?:localhost|127\.0\.0\.1):\d+(/[^\s?]*)")
    paths = [m[1] for a in args if (m := local.fullmatch(a))]
    return [f"the server has no route {path}" for path in paths if path not in routes()]


def check_sluice(args: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Problems with one `sluice ...` command line (args after `sluice`): unknown subcommands or flags."""
    parser = parser or sluice_parser()
    problems = []
    for arg in args:
        subs = _subparsers(parser)
        if arg.startswith("--"):
            if arg.split("=", 1)[0] not in _options(parser):
                problems.append(f"`{parser.prog}` has no flag {arg.split('=', 1)[0]}")
        elif subs and not arg.startswith("-"):
            if arg not in subs:
                problems.append(f"`{parser.prog}` has no subcommand {arg!r}")
                break
            parser = subs[arg]
    return problems


def check_command(tokens: list[str], targets: set[str] | None = None) -> list[str]:
    """Problems with one command: `sluice` flags and subcommands, `make` targets (and `make serve ARGS=...`),
    the paths a `curl` of the local server asks for."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):  # FOO=bar sluice ...
        tokens = tokens[1:]
    if not tokens:
        return []
    if Path(tokens[0]).name == "sluice":
        return check_sluice(tokens[1:])
    if tokens[0] == "curl":
        return check_curl(tokens[1:])
    if tokens[0] != "make":
        return []
    targets = make_targets() if targets is None else targets
    named = [t for t in tokens[1:] if "=" not in t and not t.startswith("-")]
    problems = [f"the Makefile has no target {t!r}" for t in named if t not in targets]
    for assignment in (t for t in tokens[1:] if t.startswith("ARGS=")):
        if "serve" in named:  # `make serve ARGS="..."` hands them to `sluice serve`
            problems += check_sluice(["serve", *shlex.split(assignment.removeprefix("ARGS="))])
    return problems


def check_inline(span: str) -> list[str]:
    """Problems with one `code span` of prose: a command, or a bare `--flag` naming no flag of `sluice`."""
    if span.startswith(("sluice ", "make ")):
        try:
            words = shlex.split(span)
        except ValueError:
            return []
        return check_command([w for w in words if w not in ("…", "...")])
    flag = re.match(r"--[a-z0-9][a-z0-9-]*", span)
    if flag and flag.group() not in all_sluice_flags() | FOREIGN_FLAGS:
        return [f"no `sluice` command has a flag {flag.group()}"]
    return []


def check_text(text: str, name: str = "<text>") -> list[str]:
    """Every problem in one markdown text: commands in shell blocks, commands and flags in code spans."""
    problems = []
    for block in blocks(text, name):
        if block.lang in SHELL:
            problems += [f"{block.where}: {p}" for c in commands(block) for p in check_command(c)]
    prose = _FENCE.sub("", text)
    for line_no, line in enumerate(prose.splitlines(), 1):
        spans = _INLINE.finditer(line)
        problems += [f"{name} (prose line {line_no}): {p}" for m in spans for p in check_inline(m[1])]
    return problems


# ---- the docs themselves

def test_the_generated_sections_match_the_code():
    for path, text in gen_docs.render().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run `{gen_docs.COMMAND}`"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_command_in_the_docs_exists(path: Path):
    problems = check_text(path.read_text(), str(path.relative_to(REPO)))
    assert not problems, "\n".join(problems)


def test_the_docs_link_to_files_that_exist():
    missing = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith(("http://", "https://")) and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(REPO)} -> {target}")
    assert not missing, "\n".join(missing)


def _runnable() -> list[Block]:
    return [b for p in DOC_FILES for b in blocks(p.read_text(), str(p.relative_to(REPO))) if b.runnable]


def test_the_readme_and_docs_mark_blocks_runnable():
    assert any(b.where.startswith("README.md") for b in _runnable())
    assert all(b.lang in SHELL for b in _runnable()), "only shell blocks can be marked runnable"


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.where)
def test_runnable_blocks_run(block: Block, tmp_path: Path):
    # `sluice` is this checkout's CLI under this interpreter, whatever is on PATH.
    shim = tmp_path / "sluice"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sluice.service.cli "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", block.text], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{block.text}\n{done.stderr[-2000:]}"


# ---- the checks can fail

def test_a_made_up_flag_subcommand_or_target_is_caught():
    text = ("```sh\nsluice serve --max-num-seqs 8 --made-up-flag 1\nsluice bench nonsense\nmake serv\n"
            "make serve ARGS=\"--port 9000 --not-a-flag\"\n"
            "curl -N localhost:8000/v1/chat/completion -d '{}'\n```\n"
            "Prose: `--max-num-seqz` and `sluice serve --also-made-up`.\n")
    problems = "\n".join(check_text(text))
    for wrong in ("--made-up-flag", "'nonsense'", "'serv'", "--not-a-flag", "--max-num-seqz", "--also-made-up",
                  "route /v1/chat/completion\n"):
        assert wrong in problems, f"{wrong} not caught in:\n{problems}"
    assert "--max-num-seqs" not in problems and "--port" not in problems


def test_real_commands_pass():
    text = ("```sh\nSLUICE_PORT=9000 sluice serve --port 9000 --no-prefix-caching | grep x  # comment\n"
            "sluice bench offline --profile && make test-fast\ncurl -s http://127.0.0.1:8000/v1/models\n"
            "make serve ARGS=\"--quantization int4\"\n```\n"
            "<!-- runnable -->\n```console\n$ sluice serve --help\nusage: sluice serve --nothing-checked\n```\n"
            "Prose: `--vllm-metric-names`, `--dtype auto`, `make gpu-check GPU_CHECK_ARGS=--tiny`.\n")
    assert check_text(text) == []
    assert [b.runnable for b in blocks(text)] == [False, True]


def test_commands_are_split_at_pipes_and_continuations():
    block = Block("x", "sh", "sluice serve \\\n  --port 1 | grep -- --port; make lint # make nothing\n", False)
    assert commands(block) == [["sluice", "serve", "--port", "1"], ["grep", "--", "--port"], ["make", "lint"]]


def test_a_stale_generated_section_is_rewritten(tmp_path: Path):
    for name in {name for name, _ in gen_docs.SECTIONS}:
        (tmp_path / name).write_text((REPO / "docs" / name).read_text())
    ops = tmp_path / "operations.md"
    ops.write_text(ops.read_text().replace("| `--max-num-seqs` |", "| `--max-num-seqz` |"))
    rendered = gen_docs.render(tmp_path)
    assert rendered[ops] == (REPO / "docs" / "operations.md").read_text()
    (tmp_path / "api.md").write_text("no markers\n")
    with pytest.raises(KeyError, match="markers"):
        gen_docs.render(tmp_path)


def test_request_fields_read_a_pydantic_style_document():
    """$ref, anyOf with null and OpenAPI 3.1's numeric exclusiveMinimum, as pydantic writes them."""
    spec = {"paths": {"/p": {"post": {"requestBody": {"content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Req"}}}}}}},
        "components": {"schemas": {
            "Req": {"type": "object", "required": ["prompt"], "properties": {
                "prompt": {"anyOf": [{"type": "string", "maxLength": 9}, {"type": "null"}], "description": "P"},
                "top_p": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}],
                          "default": 1},
                "mode": {"$ref": "#/components/schemas/Mode"}}},
            "Mode": {"type": "string", "enum": ["a", "b"]}}}}
    table = gen_docs.request_fields("/p", spec)
    assert "| `prompt` (required) | string |  | length <= 9 | P |" in table
    assert "| `top_p` | number | `1` | <= 1, > 0 |" in table
    assert '| `mode` | "a" \\| "b" |' in table
