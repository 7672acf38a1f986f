"""The repository as a product: what a user clones must stand on its own.

* nothing shipped cites a file that is not in the repository (the team's design notes, the
  source papers by their file names);
* the README stays short enough to read at one sitting (the details live in docs/);
* a virtual environment at the project's standard paths is ignored by git whether it is a
  directory or a symlink to one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What a user receives: the product, its docs, examples, deployment, benchmarks and their workloads.
SHIPPED = ("sidecar", "clients", "bench", "workloads", "examples", "docs", "deploy", "proto", "README.md", "dev")
SUFFIXES = {".py", ".md", ".proto", ".yaml", ".yml", ".toml", ".txt", ".json", ""}
#: Files outside the repository: the team's design notes, the seeds folder, a parent path.
OUTSIDE = re.compile(r"ARCHITECTURE\.md|STYLE\.md|\.\./shared|shared/seeds|\bseed 00\d\b")
README_MAX_LINES = 200


def _shipped_files() -> list[Path]:
    files: list[Path] = []
    for name in SHIPPED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for f in path.rglob("*"):
            if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                if "results" in f.parts and f.suffix == ".json":
                    continue  # measured data, no prose
                files.append(f)
    return files


def test_nothing_shipped_cites_a_file_outside_the_repository() -> None:
    offenders = []
    for f in _shipped_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not offenders, "cite the repository's own docs instead:\n" + "\n".join(offenders)


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move detail to docs/"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git binary")
@pytest.mark.parametrize("name", [".venv", ".venv-engines"])
def test_symlinked_environment_is_ignored(tmp_path: Path, name: str) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    target = tmp_path / "env"
    target.mkdir()
    (repo / name).symlink_to(target, target_is_directory=True)
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                         check=True, capture_output=True, text=True).stdout.split("\n")
    assert f"?? {name}" not in out, f"a symlinked {name} shows as untracked: {out}"
    assert "?? .gitignore" in out  # git itself sees untracked files here
