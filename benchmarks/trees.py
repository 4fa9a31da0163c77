"""Run another git revision's code beside the working tree's: a temporary worktree of it,
and the PYTHONPATH and module prefix that import that tree's packages rather than the
installed ones. Used by the benchmarks that compare revisions side by side in one run
(`ab.py`, `router_startup.py --compare-ref`)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def worktree(ref: str, where: Path) -> Iterator[Path]:
    """A detached worktree of `ref` at `where`, removed on exit."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), ref], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)


def importable(tree: Path, shim: Path) -> tuple[str, str]:
    """(PYTHONPATH, module prefix) that import `tree`'s packages rather than the installed
    ones. Trees since the one namespace install each directory as pdserve.<dir> (setup.py):
    `shim` gets a `pdserve/` of links to them, and modules are `pdserve.router` etc. Older
    trees imported their directories by their own names (`router`)."""
    if not (tree / "setup.py").exists():
        return str(tree), ""
    (shim / "pdserve").mkdir(parents=True, exist_ok=True)
    for package in tree.iterdir():
        link = shim / "pdserve" / package.name
        if (package / "__init__.py").exists() and not link.exists():
            link.symlink_to(package)
    return str(shim), "pdserve."
