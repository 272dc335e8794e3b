"""The suite's own shape: tests/conftest.py puts unit/, model/ and system/ on the path, so two test
modules of one basename in two folders stop collection ("import file mismatch") and CI runs nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_modules_share_a_name():
    names = Counter(p.name for folder in ("unit", "model", "system") for p in (TESTS / folder).glob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
