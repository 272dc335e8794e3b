"""The suite's own shape: tests/conftest.py puts unit/, model/ and system/ on the path, so two test
modules of one basename in two folders stop collection ("import file mismatch") and CI runs nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_modules_share_a_name():
    names = Counter(p.name for folder in ("unit", "model", "system") for p in (TESTS / folder).glob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []


def test_no_benchmark_script_shadows_an_installed_module():
    """Tests that import a benchmark put benchmarks/ first on sys.path for the whole session: a
    script named like an installed package (benchmarks/onnx.py, once) then stands in for it, and
    every later ONNX load failed "model.onnx is not a readable ONNX model"."""
    import importlib.machinery
    import sys

    path = [p for p in sys.path if Path(p).resolve() != (TESTS.parent / "benchmarks").resolve()]
    scripts = [p.stem for p in (TESTS.parent / "benchmarks").glob("*.py")]
    assert [s for s in scripts if importlib.machinery.PathFinder.find_spec(s, path) is not None] == []


def test_the_heavy_files_that_go_first_exist():
    """conftest's HEAVY_FIRST names files by path: a renamed one would silently fall back in line."""
    from conftest import HEAVY_FIRST

    assert [name for name in HEAVY_FIRST if not (TESTS / name).is_file()] == []
