"""File contents of the Batch API in the data directory (`<home>/batches/files/<id>`).

Every file appears whole or not at all: it is written under `.tmp/`, fsynced and renamed into
place, so a daemon killed mid-write leaves only a temporary that the next start sweeps. Only ids
the store knows are ever turned into paths, and ids are ours (`file-<hex>`), so no client string
reaches the filesystem.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import IO, Any, Iterable

from ..errors import DiskFullError


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def file_object(file_id: str, filename: str, purpose: str, size: int, created_at: int | None = None) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at or int(time.time()),
            "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}


class FileStorage:
    def __init__(self, root: Path, min_free_bytes: int):
        self.root = root
        self.tmp = root / ".tmp"
        self.min_free = min_free_bytes
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def staging(self) -> tuple[Path, IO[bytes]]:
        """A new temporary file under .tmp/, open for writing."""
        path = self.tmp / f"{uuid.uuid4().hex}.part"
        return path, open(path, "wb")

    def check_room(self, needed: int, what: str = "batch files") -> None:
        """DiskFullError (507) unless `needed` bytes of `what` still leave batch_min_free_disk free."""
        free = shutil.disk_usage(self.root).free
        if free - needed < self.min_free:
            raise DiskFullError(f"not enough free disk for {needed} bytes of {what} "
                                f"(setting batch_min_free_disk keeps {self.min_free} bytes free)")

    def publish(self, tmp: Path, file_id: str) -> None:
        """Move a finished temporary into place (fsynced first, so the rename never exposes a hole)."""
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path(file_id))
        _fsync_dir(self.root)

    def write_lines(self, file_id: str, lines: Iterable[str]) -> int:
        """Write JSONL atomically as `file_id` (replacing a copy an interrupted run left); its size."""
        path, f = self.staging()
        size = 0
        try:
            with f:
                for line in lines:
                    data = line.encode("utf-8") + b"\n"
                    size += len(data)
                    if size % (1 << 20) < len(data):  # about every MiB: stop before the disk is full
                        self.check_room(1 << 20)
                    f.write(data)
            self.check_room(0)
            self.publish(path, file_id)
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError("the disk is full; batch files could not be written") from None
            raise
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def sweep(self, known: set[str]) -> None:
        """Remove temporaries and files no store row names (a kill between rename and insert)."""
        for entry in self.tmp.iterdir():
            entry.unlink(missing_ok=True)
        for entry in self.root.iterdir():
            if entry.is_file() and entry.name not in known:
                entry.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open directories; its rename is durable enough
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
