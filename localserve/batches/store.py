"""Durable Batch API state: stdlib sqlite3 in WAL mode, one connection, used off the event loop.

A line's row goes from `result IS NULL` (pending) to its final output/error line in one
transaction (`record` only updates a NULL result), so a line is never answered twice and, since
WAL with synchronous=NORMAL survives a killed process (not only a clean exit), never lost once
recorded. The batch object itself is a JSON document with its status mirrored in a column.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from ..errors import ConfigError, NotFoundError

SCHEMA_VERSION = 1
TERMINAL = ("completed", "failed", "expired", "cancelled")
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, request TEXT NOT NULL,
    result TEXT, is_error INTEGER, PRIMARY KEY (batch_id, idx));
"""


class BatchStore:
    """Files' metadata, batches and their lines. Async methods run the SQL in a worker thread."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()  # one connection, one statement sequence at a time
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise ConfigError(f"batch database schema {row[0]} is not {SCHEMA_VERSION} (made by another version)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    def _tx(self) -> "_Tx":
        return _Tx(self._db, self._lock)

    # --- files ---------------------------------------------------------------------------
    def add_file(self, obj: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files (id, data) VALUES (?, ?)", (obj["id"], json.dumps(obj)))

    def get_file(self, file_id: str) -> dict[str, Any]:
        with self._tx() as db:
            row = db.execute("SELECT data FROM files WHERE id=?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no file with id {file_id[:80]!r}", param="file_id")
        return json.loads(row[0])

    def list_files(self) -> list[dict[str, Any]]:
        with self._tx() as db:
            rows = db.execute("SELECT data FROM files ORDER BY seq DESC").fetchall()
        return [json.loads(r[0]) for r in rows]

    def file_ids(self) -> set[str]:
        with self._tx() as db:
            return {r[0] for r in db.execute("SELECT id FROM files")}

    def delete_file(self, file_id: str) -> None:
        with self._tx() as db:
            if db.execute("DELETE FROM files WHERE id=?", (file_id,)).rowcount == 0:
                raise NotFoundError(f"no file with id {file_id[:80]!r}", param="file_id")

    # --- batches -------------------------------------------------------------------------
    def create_batch(self, obj: dict[str, Any], lines: list[tuple[str | None, str]]) -> None:
        """The batch and all its lines, in one transaction: a batch never exists half-written."""
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, status, data) VALUES (?, ?, ?)",
                       (obj["id"], obj["status"], json.dumps(obj)))
            db.executemany("INSERT INTO lines (batch_id, idx, custom_id, request) VALUES (?, ?, ?, ?)",
                           ((obj["id"], i, cid, raw) for i, (cid, raw) in enumerate(lines)))

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        with self._tx() as db:
            row = db.execute("SELECT data FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no batch with id {batch_id[:80]!r}", param="batch_id")
            return self._with_counts(db, json.loads(row[0]))

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, as OpenAI lists them; `after` is the id of the last batch of a previous page."""
        with self._tx() as db:
            start = 1 << 62
            if after is not None:
                row = db.execute("SELECT seq FROM batches WHERE id=?", (after,)).fetchone()
                if row is None:
                    raise NotFoundError(f"no batch with id {after[:80]!r}", param="after")
                start = row[0]
            rows = db.execute("SELECT data FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                              (start, limit + 1)).fetchall()
            items = [self._with_counts(db, json.loads(r[0])) for r in rows[:limit]]
        return items, len(rows) > limit

    def unfinished(self) -> list[tuple[str, str, list[str] | None]]:
        """(id, status, models) of every batch not in a final state, oldest first: the runner's
        queue. `models` are the ones its lines name (None: unknown, a batch from before they were
        recorded, or too many)."""
        with self._tx() as db:
            rows = db.execute("SELECT id, status, data FROM batches WHERE status NOT IN (?, ?, ?, ?) ORDER BY seq",
                              TERMINAL).fetchall()
        return [(r[0], r[1], json.loads(r[2]).get("_models")) for r in rows]

    def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        """Set fields of the batch object (status among them) in one transaction; the new object."""
        with self._tx() as db:
            row = db.execute("SELECT data FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no batch with id {batch_id[:80]!r}", param="batch_id")
            obj = {**json.loads(row[0]), **fields}
            db.execute("UPDATE batches SET status=?, data=? WHERE id=?", (obj["status"], json.dumps(obj), batch_id))
            return self._with_counts(db, obj)

    # --- lines ---------------------------------------------------------------------------
    def pending_lines(self, batch_id: str) -> list[tuple[int, str | None, str]]:
        with self._tx() as db:
            return db.execute("SELECT idx, custom_id, request FROM lines WHERE batch_id=? AND result IS NULL "
                              "ORDER BY idx", (batch_id,)).fetchall()

    def record(self, batch_id: str, idx: int, result: str, is_error: bool) -> bool:
        """The line's final answer; False (nothing written) if it already had one."""
        with self._tx() as db:
            cur = db.execute("UPDATE lines SET result=?, is_error=? WHERE batch_id=? AND idx=? AND result IS NULL",
                             (result, int(is_error), batch_id, idx))
            return cur.rowcount == 1

    def close_pending(self, batch_id: str, make: Callable[[int, str | None], str]) -> None:
        """Give every still-pending line the error line `make(idx, custom_id)`, in one transaction."""
        with self._tx() as db:
            rows = db.execute("SELECT idx, custom_id FROM lines WHERE batch_id=? AND result IS NULL",
                              (batch_id,)).fetchall()
            db.executemany("UPDATE lines SET result=?, is_error=1 WHERE batch_id=? AND idx=?",
                           ((make(idx, cid), batch_id, idx) for idx, cid in rows))

    def results(self, batch_id: str, is_error: bool) -> Iterator[str]:
        """The recorded output (or error) lines in input order, read in pages."""
        last = -1
        while True:
            with self._tx() as db:
                rows = db.execute("SELECT idx, result FROM lines WHERE batch_id=? AND is_error=? AND idx>? "
                                  "ORDER BY idx LIMIT 1000", (batch_id, int(is_error), last)).fetchall()
            if not rows:
                return
            for idx, result in rows:
                yield result
            last = rows[-1][0]

    @staticmethod
    def _with_counts(db: sqlite3.Connection, obj: dict[str, Any]) -> dict[str, Any]:
        total, done, failed = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(is_error=0), 0), COALESCE(SUM(is_error=1), 0) FROM lines "
            "WHERE batch_id=?", (obj["id"],)).fetchone()
        obj["request_counts"] = {"total": total, "completed": done, "failed": failed}
        return obj


class _Tx:
    """`with` = the connection's lock and one transaction (BEGIN IMMEDIATE .. COMMIT / ROLLBACK)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self.db = db
        self.lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type:
                self._rollback()
            else:
                try:
                    self.db.execute("COMMIT")
                except BaseException:  # a COMMIT that fails (a full disk) must not leave it open
                    self._rollback()
                    raise
        finally:
            self.lock.release()

    def _rollback(self) -> None:
        # SQLite has already rolled back after some errors (SQLITE_FULL: a full disk); a second
        # ROLLBACK would raise and hide the error that says what happened.
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
