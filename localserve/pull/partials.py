"""Sweeping abandoned `.partial` downloads out of the cache.

A pull interrupted for good (the link died, the user gave up) leaves its partial beside the target
so that a later pull resumes; nothing else ever removes it, and a multi-GB partial nobody resumes
is a leak. Each pull therefore deletes partials not written to for `partial_max_age_days`. A pull
in progress holds its model's lock (and writes its partial continuously), so the partials of a
locked model are left alone whatever their age. A folder pull stages its files in a `.partial`
folder (folder.py); its age is that of the newest file in it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from ..store.cache import LOCKS_DIR, FileLock

log = logging.getLogger(__name__)
PARTIAL_SUFFIX = ".partial"
NOTE_SUFFIX = ".partial.json"  # the identity note claim_partial writes beside a partial


def _last_written(path: Path) -> float:
    """A file's mtime; a staging folder's newest mtime (appending to a file inside it does not
    touch the folder's own)."""
    if not path.is_dir():
        return path.stat().st_mtime
    times = [path.stat().st_mtime]
    for root, _, names in os.walk(path):
        times += [(Path(root) / name).stat().st_mtime for name in names]
    return max(times)


def _stale(directory: Path, cutoff: float) -> list[Path]:
    stale = []
    for path in directory.iterdir():
        if path.name.endswith((PARTIAL_SUFFIX, NOTE_SUFFIX)):
            try:
                if _last_written(path) < cutoff:
                    stale.append(path)
            except OSError:
                pass  # removed meanwhile
    return stale


def _model_dirs(root: Path) -> list[Path]:
    """models/<name>/<tag> folders; dot-folders (.locks, .tmp) are ours, not models."""
    dirs = []
    for name_dir in root.iterdir():
        if name_dir.name.startswith(".") or not name_dir.is_dir():
            continue
        dirs.extend(d for d in name_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    return dirs


def sweep_stale_partials(root: Path, max_age_s: float) -> list[Path]:
    """Delete partial downloads (and their notes) under `root` older than `max_age_s`; 0 keeps all.
    Returns what was deleted."""
    if max_age_s <= 0 or not root.is_dir():
        return []
    cutoff = time.time() - max_age_s
    removed: list[Path] = []
    for tag_dir in _model_dirs(root):
        stale = _stale(tag_dir, cutoff)
        if not stale:
            continue
        # The same lock file ModelStore.lock uses: <name dir>@<tag>.lock.
        lock = FileLock(root / LOCKS_DIR / f"{tag_dir.parent.name}@{tag_dir.name}.lock")
        if not lock.acquire(blocking=False):
            continue  # a pull of this model is running
        try:
            for path in stale:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
                log.info("removed an abandoned partial download %s", path.name)
            for directory in (tag_dir, tag_dir.parent):  # under the lock: no pull is creating them
                try:
                    directory.rmdir()  # only when the partial was all it held
                except OSError:
                    break
        finally:
            lock.release()
    return removed
