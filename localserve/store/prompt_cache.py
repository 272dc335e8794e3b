"""The prompt cache on disk: what the prefix cache parked, kept across unloads, restarts and crashes.

A coding agent sends 10-20k tokens of tools and instructions before its first question; after a
keep_alive unload, a daemon restart or a worker crash the in-memory prefix cache is gone, and on a
CPU computing that prompt again is a minute or more. So a parked sequence's KV state (the
backend's own bytes: llama.cpp's per-sequence state) is written here, and read back on a prefix hit.

Layout, under the data home:

    prompt-cache/<model file's sha256>/<entry digest>.kv   one parked sequence
    prompt-cache/<model file's sha256>/.<name>.<pid>.tmp   a file being written (renamed when whole)

A file: MAGIC, a 4-byte header length, a JSON header (`key`, `tokens`, `state`, `sha256`), the
tokens as little-endian int32, then the state bytes. `key` names the engine that wrote it (the
llama.cpp build, KV layout and type: engine/prompt_disk.py), and a file is only ever read into
an engine with the same key: a state read into another build or layout is at best refused by
llama.cpp and at worst a wrong answer. `sha256` covers the key, the tokens and the state, so a
truncated, foreign or tampered file is found before a byte of it reaches the engine; such a file is
removed and the prompt computed as if it were not there.

Bounded by `prompt_cache_disk_bytes` over all models together, and never below a tenth of the
disk left free; least recently used (file mtime, touched on each hit) go first. The folder is the
user's alone (0700, files 0600: config/private.py): the files hold prompts.

Threads: `lookup` and `read` run on the engine thread; writes go through one writer thread, so
the engine never waits for a disk. The writer sleeps on its queue (0% CPU when idle).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import queue
import shutil
import sys
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..config.private import FILE_MODE, private_dir
from .names import safe_component

log = logging.getLogger(__name__)

FOLDER = "prompt-cache"
SUFFIX = ".kv"
MAGIC = b"LSPC\x01"
_HEADER_MAX = 4096  # a header is ~200 bytes; anything bigger is not ours
_FREE_SHARE = 0.10  # the cache never fills the disk past this much free space
# The writer gives glibc's freed heap back once no state has come to write for this long, not each
# time its queue empties: under load the next state (allocated on the engine thread) would fault the
# same pages in again: load B ran 3-20% faster (median 5%) without a trim after each write (3 rounds,
# benchmarks/serve.py's load B with the disk cache on, 2026-12-07).
TRIM_AFTER_S = 5.0


def cache_root(home: Path) -> Path:
    """The prompt cache's folder in the data home `home`."""
    return home / FOLDER


def remove_model(home: Path, model_sha256: str | None) -> int:
    """Delete a model's cached prompts (`localserve rm`); the bytes freed."""
    if not model_sha256:
        return 0
    return _remove_tree(cache_root(home) / safe_component(model_sha256, "model digest"))


def clear(home: Path) -> int:
    """Delete every cached prompt of every model (`localserve cache clear`); the bytes freed."""
    return _remove_tree(cache_root(home))


def usage(home: Path) -> tuple[int, int]:
    """(files, bytes) the prompt cache holds now."""
    files = _all_files(cache_root(home))
    return len(files), sum(size for _, size, _ in files)


@dataclass
class DiskEntry:
    """One file: the tokens its state holds at positions 0..len-1."""

    path: Path
    tokens: list[int]
    size: int


class PromptDiskCache:
    """One engine's view of its model's folder: an index of the files its engine may read, the
    writer thread, the bound."""

    def __init__(self, home: Path, model_sha256: str, engine_key: str, max_bytes: int):
        self.root = cache_root(home)
        self.folder = self.root / safe_component(model_sha256, "model digest")
        # The model's digest is in the key too, not only the folder's name: a file copied into
        # another model's folder is another engine's file.
        self.key = f"{model_sha256} {engine_key}"
        self.max_bytes = max_bytes
        self._index: dict[Path, DiskEntry] = {}
        self._lock = threading.Lock()  # the index: the engine thread reads, the writer thread writes
        self._jobs: queue.Queue[tuple[list[int], bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._pending = 0  # jobs queued or being written (flush waits for 0)
        self._idle = threading.Condition(self._lock)
        self.written = 0  # files written, refused (bad) and bytes read back: for logs and tests
        self.refused = 0

    # --- opening -------------------------------------------------------------------------
    def open(self) -> PromptDiskCache:
        """Make the folders user-only, drop what a killed writer left, index the files whose
        header says this engine wrote them; a foreign or broken file is removed."""
        private_dir(self.root)
        private_dir(self.folder)
        for path in self.folder.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write cut short by a crash or a kill
            elif path.suffix == SUFFIX:
                entry = self._read_index(path)
                if entry is not None:
                    self._index[path] = entry
        return self

    def _read_index(self, path: Path) -> DiskEntry | None:
        try:
            with open(path, "rb") as f:
                header = _read_header(f)
                if header is None or header["key"] != self.key:
                    raise _Bad("another engine's file" if header else "no header")
                n, state = header["tokens"], header["state"]
                size = os.fstat(f.fileno()).st_size
                if size != f.tell() + 4 * n + state:
                    raise _Bad(f"{size} bytes, not the {4 * n + state} its header says")
                tokens = list(struct.unpack(f"<{n}i", _read_exactly(f, 4 * n)))
        except (OSError, ValueError, KeyError, TypeError, struct.error, _Bad) as e:
            self._refuse(path, str(e))
            return None
        return DiskEntry(path, tokens, size)

    # --- the engine thread ---------------------------------------------------------------
    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._index.values())

    def read(self, entry: DiskEntry) -> bytes | None:
        """The state `entry` holds, checked against its digest; None (and the file removed when
        it is bad) when it is gone, truncated, foreign or altered."""
        try:
            with open(entry.path, "rb") as f:
                header = _read_header(f)
                if header is None or header["key"] != self.key:
                    raise _Bad("another engine's file")
                n, size = header["tokens"], header["state"]
                tokens_bytes = _read_exactly(f, 4 * n)
                state = _read_exactly(f, size)
                if f.read(1):
                    raise _Bad("bytes past its end")
            if _digest(self.key, tokens_bytes, state) != header["sha256"]:
                raise _Bad("its checksum does not match")
            if list(struct.unpack(f"<{n}i", tokens_bytes)) != entry.tokens:
                raise _Bad("its tokens changed since it was indexed")
            os.utime(entry.path)  # least recently used goes first
        except FileNotFoundError:  # removed by the bound or `cache clear` meanwhile: a miss
            self._forget(entry.path)
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error, _Bad) as e:
            self._refuse(entry.path, str(e))
            return None
        return state

    def save(self, tokens: Sequence[int], state: bytes) -> None:
        """Write a parked sequence's state, on the writer thread."""
        with self._lock:
            self._pending += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="prompt-cache-writer", daemon=True)
                self._writer.start()
        self._jobs.put((list(tokens), state))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is on disk (an unload's last saves); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # --- the writer thread ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            try:
                first = self._jobs.get(timeout=TRIM_AFTER_S)
            except queue.Empty:  # quiet for a while: the freed states' heap goes back to the OS
                _give_back_free_heap()
                first = self._jobs.get()
            jobs = [first]
            while True:  # what queued up meanwhile: a later turn of a conversation supersedes an earlier
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for i, (tokens, state) in enumerate(jobs):
                try:
                    if not any(_extends(later, tokens) for later, _ in jobs[i + 1:]):
                        self._write(tokens, state)
                except Exception:  # noqa: BLE001 - a full or read-only disk costs a cache entry, nothing else
                    log.warning("could not write a prompt cache file", exc_info=True)
                finally:
                    with self._lock:
                        self._pending -= 1
                        self._idle.notify_all()
            del jobs, first, tokens, state

    def _write(self, tokens: list[int], state: bytes) -> None:
        tokens_bytes = struct.pack(f"<{len(tokens)}i", *tokens)
        header = json.dumps({"key": self.key, "tokens": len(tokens), "state": len(state),
                             "sha256": _digest(self.key, tokens_bytes, state)}).encode()
        name = hashlib.sha256(self.key.encode() + tokens_bytes).hexdigest()[:40] + SUFFIX
        path = self.folder / name
        size = len(MAGIC) + 4 + len(header) + len(tokens_bytes) + len(state)
        if not self._make_room(size):
            log.info("prompt cache: no room for %d MB on this disk; not written", size >> 20)
            return
        private_dir(self.folder)  # `cache clear` may have removed it since open()
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(tokens_bytes)
                f.write(state)
            os.replace(tmp, path)  # readers see a whole file or none
        finally:
            tmp.unlink(missing_ok=True)
        superseded = []
        with self._lock:
            for old in list(self._index.values()):
                if old.path != path and _extends(tokens, old.tokens):
                    superseded.append(old.path)  # an earlier turn of the same conversation
                    del self._index[old.path]
            self._index[path] = DiskEntry(path, tokens, size)
            self.written += 1
        for old_path in superseded:
            old_path.unlink(missing_ok=True)

    def _make_room(self, incoming: int) -> bool:
        """Remove least recently used files (every model's) until `incoming` more bytes fit the
        bound and the disk's free share; False when it cannot fit at all."""
        files = sorted(_all_files(self.root), key=lambda f: f[2])  # oldest use first
        total = sum(size for _, size, _ in files)
        disk = shutil.disk_usage(self.root)
        allowed = min(self.max_bytes, total + disk.free - int(disk.total * _FREE_SHARE))
        if incoming > allowed:
            return False
        for path, size, _ in files:
            if total + incoming <= allowed:
                break
            path.unlink(missing_ok=True)
            self._forget(path)
            total -= size
        return True

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("prompt cache: removed %s: %s", path.name, why)
        self.refused += 1
        path.unlink(missing_ok=True)
        self._forget(path)

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)


def _give_back_free_heap() -> None:
    """Return glibc's free heap memory to the OS. The states written here are tens of MB each,
    allocated on the engine thread and freed here; glibc keeps such freed chunks in its arenas
    (its mmap threshold grows past them after the first free), so an idle engine whose parked
    conversations went to disk still held ~75 MB of them a minute later (issue 42)."""
    trim = getattr(_libc, "malloc_trim", None) if _libc is not None else None
    if trim is not None:
        trim(0)


def _load_libc():
    try:
        return ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    except OSError:  # no C library to speak to: nothing to trim
        return None


_libc = _load_libc()


class _Bad(Exception):
    """A file that is not a whole prompt cache file of this engine."""


def _extends(longer: Sequence[int], shorter: Sequence[int]) -> bool:
    return len(longer) >= len(shorter) and list(longer[: len(shorter)]) == list(shorter)


def _digest(key: str, tokens_bytes: bytes, state: bytes) -> str:
    h = hashlib.sha256(key.encode())
    h.update(tokens_bytes)
    h.update(state)
    return h.hexdigest()


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Bad(f"truncated ({len(data)} of {n} bytes)")
    return data


def _read_header(f) -> dict | None:
    if f.read(len(MAGIC)) != MAGIC:
        return None
    (length,) = struct.unpack("<I", _read_exactly(f, 4))
    if length > _HEADER_MAX:
        raise _Bad("its header is too long")
    header = json.loads(_read_exactly(f, length))
    if not (isinstance(header, dict) and isinstance(header.get("key"), str)
            and all(isinstance(header.get(k), int) and header[k] >= 0 for k in ("tokens", "state"))
            and isinstance(header.get("sha256"), str)):
        raise _Bad("a header without its fields")
    return header


def _all_files(root: Path) -> list[tuple[Path, int, float]]:
    """(path, size, mtime) of every cache file of every model."""
    found = []
    if not root.is_dir():
        return found
    for folder in root.iterdir():
        if not folder.is_dir() or folder.is_symlink():
            continue
        for path in folder.glob("*" + SUFFIX):
            try:
                st = path.lstat()
            except OSError:
                continue
            found.append((path, st.st_size, st.st_mtime))
    return found


def _remove_tree(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return 0
    freed = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(path, ignore_errors=True)
    return freed
