"""An earlier commit of Sluice, runnable beside this one: `sluice bench peers --baseline REF`.

The commit is checked out as a detached git worktree in the cache, with a virtual environment that sees this
one's packages through a .pth file and installs only Sluice itself, so nothing is downloaded and both run on
the same torch. Runs alternate between the two so that a machine whose speed drifts drifts for both.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def resolve(ref: str) -> str:
    """The full commit hash of `ref` in this checkout."""
    return _git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()


def baseline_python(ref: str, cache: Path, log=print) -> Path:
    """A Python interpreter whose `sluice` is commit `ref` (set up once, cached under `cache`)."""
    sha = resolve(ref)
    tree = cache / f"baseline-{sha[:12]}"
    python = tree / ".venv" / "bin" / "python"
    if (tree / ".venv" / ".ready").is_file():
        return python
    if not (tree / ".git").exists():
        log(f"checking out {ref} ({sha[:12]}) into {tree}")
        cache.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--force", "--detach", str(tree), sha)
    subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
    site = next((tree / ".venv" / "lib").glob("python*/site-packages"))
    # every site directory this interpreter reads (a venv may itself reach its packages through a .pth file)
    parents = dict.fromkeys([sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("site-packages"))])
    (site / "zz_parent_env.pth").write_text("".join(f"{p}\n" for p in parents))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)],
                   check=True, capture_output=True)
    (tree / ".venv" / ".ready").touch()
    return python


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout
