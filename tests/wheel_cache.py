"""The llama-cpp-python wheel of exactly the installed build, from pip's wheel cache: what the
installer and `setup --wheels` tests install instead of compiling llama.cpp again (CI's README
command puts it in the cache it keeps until the suite ends)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def _record_hash(lines: list[list[str]], suffix: str) -> str | None:
    return next((row[1] for row in lines if row and row[0].endswith(suffix)), None)


def wheel_of_this_build(dest: Path) -> Path | None:
    """The cached wheel whose libllama.so is the installed one, copied into `dest` (pip's cache
    ignores CFLAGS, so a cached wheel may be another flavour: only an identical library will do)."""
    dist = metadata.distribution("llama-cpp-python")
    record = next(f for f in dist.files or [] if f.name == "RECORD")
    wanted = _record_hash(list(csv.reader(Path(record.locate()).read_text().splitlines())), "lib/libllama.so")
    done = subprocess.run([sys.executable, "-m", "pip", "cache", "list", "llama_cpp_python*", "--format=abspath"],
                          capture_output=True, text=True)
    for line in done.stdout.split():
        with zipfile.ZipFile(line) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
            rows = list(csv.reader(z.read(name).decode().splitlines()))
        if wanted and _record_hash(rows, "lib/libllama.so") == wanted:
            dest.mkdir(parents=True, exist_ok=True)
            return Path(shutil.copy(line, dest))
    return None
