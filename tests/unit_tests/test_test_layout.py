"""pytest imports test files and the modules on its path (`pythonpath` in pyproject.toml)
by basename, so two of them with one name break collection of the whole suite ("import
file mismatch") even when each directory passes alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ON_PATH = ("scripts", "benchmarks", "tests/integration_tests")


def test_no_two_test_files_or_path_modules_share_a_name():
    files = [*REPO.joinpath("tests").rglob("test_*.py")]
    files += [f for folder in ON_PATH for f in REPO.joinpath(folder).glob("*.py")]
    counts = Counter(f.name for f in set(files))
    assert [name for name, n in counts.items() if n > 1] == []
