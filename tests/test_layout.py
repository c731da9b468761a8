"""The layout holds: one installed package `sluice` mapped from the top-level folders, packages by role (rooms) whose
dependencies point one way (cli → bench → api → engine → executor → structured → attention → config → metrics →
scheduling → kvcache → root: ROOMS), no import cycles, no test tooling in the product, no oversized module, and test
folders that mirror the packages."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"sluice": "sluice", "kvcache": "sluice.kvcache", "scheduling": "sluice.scheduling",
           "service": "sluice.service", "metrics": "sluice.metrics"}
OLD_TOP_LEVEL = ("service", "kvcache", "scheduling", "metrics")
MAX_LINES = 450

# The rooms, the lowest first: each may import itself and the rooms listed (and nothing else of sluice). A room is
# a folder of the package (sluice.kvcache, sluice.service.engine, ...; `room` below): root < kvcache < scheduling <
# metrics < config < attention < structured < executor < engine < api < bench < cli, where metrics and config, side
# by side, do not import each other.
ROOMS = {
    "root": set(),  # sluice/*.py: knobs, the machine's facts (machine.py, cpu.py), the native extension
    "kvcache": {"root"},  # the KV cache's memory: blocks, pool, manager, tensors, swap, events
    "scheduling": {"root", "kvcache"},
    "metrics": {"root", "kvcache", "scheduling"},
    "config": {"root", "kvcache", "scheduling"},  # sluice.service.config: the one configuration object
    "attention": {"root", "kvcache", "scheduling", "metrics", "config"},  # attention compute on the paged cache
    "structured": {"root", "kvcache", "scheduling", "metrics", "config", "attention"},  # grammars
    "executor": {"root", "kvcache", "scheduling", "metrics", "config", "attention", "structured"},  # the model
    "engine": {"root", "kvcache", "scheduling", "metrics", "config", "attention", "structured", "executor"},
    "api": {"root", "kvcache", "scheduling", "metrics", "config", "attention", "structured", "executor", "engine"},
    "bench": {"root", "kvcache", "scheduling", "metrics", "config", "attention", "structured", "executor", "engine",
              "api"},
    "cli": {"root", "kvcache", "scheduling", "metrics", "config", "attention", "structured", "executor", "engine",
            "api", "bench", "service"},
    "service": set(),  # sluice/service/__init__.py
}
# Benchmarks and development tools (docs and manifest generators, the PromQL checker, the scaling probe): in a
# source checkout (`pip install -e .`), never in the product wheel, and nothing of the product imports them.
DEVELOPMENT_ONLY = {"sluice.service.bench"}
# Third-party packages the two lowest layers never import: they know nothing of HTTP or of the model.
NOT_BELOW_SERVICE = {"aiohttp", "transformers", "orjson", "uvloop", "prometheus_client", "accelerate", "gguf",
                     "safetensors", "tests", "zmq", "msgpack", "msgspec"}  # KV events: kvcache makes, engine sends


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at module level or inside functions (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports(name, path) if m in mods and m != name} for name, path in mods.items()}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in ("kvcache", "scheduling", "metrics", "service"):
        return "root"
    if parts[1] != "service":
        return parts[1]
    if len(parts) == 2:
        return "service"
    return parts[2]


def test_every_module_lives_in_a_room():
    unknown = {m for m in modules() if room(m) not in ROOMS}
    assert not unknown, f"modules outside the known rooms {sorted(ROOMS)}: {sorted(unknown)}"


def test_dependencies_point_one_way():
    wrong = [f"{m} imports {d}" for m, deps in graph().items() for d in deps
             if room(d) != room(m) and room(d) not in ROOMS[room(m)]]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_lower_layers_know_nothing_of_http_the_model_or_the_tests():
    wrong = []
    for name, path in modules().items():
        if room(name) in ("root", "kvcache", "scheduling"):
            for imported in imports(name, path):
                if imported.split(".")[0] in NOT_BELOW_SERVICE or imported.startswith("sluice.service"):
                    wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_product_imports_no_test_code_and_reads_no_test_switch():
    wrong = []
    for name, path in modules().items():
        if any(i == "tests" or i.startswith("tests.") for i in imports(name, path)):
            wrong.append(f"{name} imports the tests")
        if "SLUICE_FAULT_INJECT" in path.read_text():
            wrong.append(f"{name} reads SLUICE_FAULT_INJECT")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_old_top_level_packages():
    """service, kvcache, scheduling, metrics exist only as sluice.*; a stray `import service` would load a
    second copy of the code from the source tree."""
    wrong = []
    files = [*modules().values(), *sorted((REPO / "tests").rglob("*.py"))]
    for path in files:
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in OLD_TOP_LEVEL]
    old = "|".join(OLD_TOP_LEVEL)
    old_m = re.compile(rf"-m\s+(?:{old})\.|[\"'](?:{old})\.(?!ya?ml\b|json\b)[a-z_]+[\"':]")
    for path in [REPO / "Makefile", REPO / "k8s" / "Dockerfile", REPO / "README.md",
                 *sorted((REPO / "docs").glob("*.md")), *files]:
        if path.exists():
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if old_m.search(line):
                    wrong.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_pyproject_maps_and_lists_every_package():
    if tomllib is None:
        return
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {package: folder for folder, package in FOLDERS.items()}
    expected = sorted({m for m, p in modules().items() if p.name == "__init__.py"} - DEVELOPMENT_ONLY)
    assert sorted(setuptools["packages"]) == expected
    data = setuptools["package-data"]
    assert "csrc/*.cpp" in data["sluice"] and "grafana-dashboard.json" in data["sluice.metrics"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sluice"] == "sluice.service.cli:main"


def test_no_module_is_oversized():
    big = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines (split them): {big}"


def test_test_modules_import_only_the_support_helpers():
    """A test module imports tests.support (and conftest fixtures arrive by name), never another test module, so
    moving or deleting one test file cannot break another."""
    wrong = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                     and not node.level and node.module else [])
            wrong += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] == "tests" and not n.startswith(("tests.support", "tests.conftest"))]
    assert not wrong, "\n".join(wrong)


# The package folder whose subpackages a test folder's subfolders mirror (the other test folders have none).
MIRRORED = {"kvcache": "kvcache", "scheduling": "scheduling", "metrics": "metrics", "attention": "service/attention",
            "structured": "service/structured", "executor": "service/executor", "engine": "service/engine",
            "api": "service/api", "bench": "service/bench"}


def test_test_folders_mirror_the_packages():
    """tests/<folder>/ exists for a package folder or a repository folder (bench, k8s), tests/<folder>/<sub>/ for
    each subpackage of the package it mirrors (tests/executor/layers/ for service/executor/layers/), so a subpackage's
    tests sit where its code does; and each holds an __init__.py so every test module has a unique dotted name."""
    known = {"kvcache", "scheduling", "attention", "structured", "executor", "engine", "api", "metrics", "bench", "k8s",
             "native", "support"}
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= known, f"test folders that mirror no package: {sorted(folders - known)}"
    assert all((REPO / "tests" / f / "__init__.py").exists() for f in folders)
    # Below the top: every folder holding Python files (a data folder is no test package).
    nested = {p.parent.relative_to(REPO / "tests").as_posix() for p in (REPO / "tests").rglob("*.py")
              if "__pycache__" not in p.parts and len(p.relative_to(REPO / "tests").parts) > 2}
    expected = {f"{tests}/{init.parent.relative_to(REPO / package).as_posix()}"
                for tests, package in MIRRORED.items() for init in (REPO / package).rglob("*/__init__.py")
                if "__pycache__" not in init.parts}
    assert nested == expected, (f"test folders that mirror no subpackage: {sorted(nested - expected)}; "
                                f"subpackages without a test folder: {sorted(expected - nested)}")
    assert all((REPO / "tests" / f / "__init__.py").exists() for f in nested)


def test_the_product_wheel_carries_no_development_tools(tmp_path):
    """The wheel `pip install sluice` gets: every product package and its data, none of DEVELOPMENT_ONLY."""
    import shutil
    import subprocess
    import sys
    import zipfile

    # From a copy of the sources: setuptools reuses a build/ folder in the tree, stale files and all.
    source = tmp_path / "src"
    at_root = {".git", ".venv", "build", "bench", "sluice.egg-info"}  # big, or what the copy must not reuse
    shutil.copytree(REPO, source, ignore=lambda folder, names: [n for n in names if n in at_root and
                                                                Path(folder) == REPO or n == "__pycache__"])
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [wheel] = tmp_path.glob("sluice-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    folders = {name.rpartition("/")[0].replace("/", ".") for name in names if name.endswith(".py")}
    assert folders == {m for m, p in modules().items() if p.name == "__init__.py"} - DEVELOPMENT_ONLY
    assert "sluice/csrc/gguf_linear.cpp" in names and "sluice/metrics/grafana-dashboard.json" in names
    assert "sluice/metrics/alerts.yml" in names and "sluice/metrics/alerts_test.yml" not in names
