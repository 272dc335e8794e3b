"""Checks a downloaded file must pass before it becomes visible: sha256, or at least a sane GGUF."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from ..protocol.progress import Progress, emit

CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path, progress: Progress = None, part: str | None = None) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None and (done == total or done % (64 * CHUNK) < CHUNK):
                emit(progress, "verifying sha256", part, done, total)
    return digest.hexdigest()


def git_blob_oid(path: Path) -> str:
    """The git blob id of a file: what the Hub's listing publishes for files kept in git (not LFS)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode("ascii"), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def facts_to_manifest(facts: Any) -> dict[str, Any]:
    """GGUF facts as plain JSON for the manifest (the chat template is kept: `show` and the
    server read it from here without reopening a multi-GB file)."""
    if dataclasses.is_dataclass(facts) and not isinstance(facts, type):
        data = dataclasses.asdict(facts)
    elif isinstance(facts, dict):
        data = dict(facts)
    else:
        data = dict(vars(facts))
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool, type(None), list, dict))}


def read_facts(path: Path) -> Any:
    """GGUF facts of `path`; raises GGUFError when the file is not a sane GGUF."""
    from .gguf_facts import read_gguf_facts

    return read_gguf_facts(path)
