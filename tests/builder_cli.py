"""The command line the test-model builders share: `python tests/NAME.py OUT_DIR` pulls SmolLM2
through our own puller (as the suite's fixtures do), builds from it into OUT_DIR and prints each
file it wrote."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterable


def run_builder(argv: list[str], doc: str, build: Callable[[Path, Path], Iterable[Path]]) -> int:
    """`build(smollm2_gguf, out_dir)` yields the files it wrote; the usage line is `doc`'s last."""
    if len(argv) != 2:
        print(doc.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    tests = Path(__file__).resolve().parent
    sys.path[:0] = [str(tests), str(tests.parent)]
    from conftest import SMOLLM2_SHA256, pulled

    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in build(pulled("smollm2-135m:Q4_1", SMOLLM2_SHA256), out_dir):
        print(path)
    return 0
