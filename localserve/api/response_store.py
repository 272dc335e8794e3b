"""Stored Responses API objects (`store`, the default): SQLite in the data directory.

What a later request needs of a stored response: the response object itself (GET
/v1/responses/{id}) and the conversation it answered, as Responses items (`context`: the previous
response's context and output, then this request's input), so `previous_response_id` rebuilds the
whole conversation, token for token the prompt the previous turn ended with, and the prefix cache
serves it.

The approach is batches/store.py's: stdlib sqlite3 in WAL mode with synchronous=NORMAL, so a
recorded response survives a killed daemon, one connection used under a lock, its SQL in a worker
thread off the event loop. It sits in api/ rather than beside batches/ because the endpoint that
reads and writes it (api/responses.py) is below batches/ (which runs /v1/responses lines through
it too), and store/ is the model cache. The connection belongs to the database file, not to an
app: `ResponseStore.of(settings)` is a plain value that the HTTP routes and the Batch API runner
make alike, and the first call opens the file's connection for the process. A connection per call
would need nothing shared, but closing a WAL database's last connection checkpoints it: a median
write of 16.5 ms instead of 0.23 ms (benchmarks/response_store.py, 16 KB contexts, this machine).

Retention (`responses_retention_days`) is lazy: every write deletes what has expired, and a read
never returns an expired response even before that. Each row holds its whole context rather than
a link to its parent, so a continuation is one read and survives a deleted ancestor; a context is
bounded by what fitted the model's context when it was answered.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..config.settings import Settings
from ..errors import ConfigError, NotFoundError

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 10.0
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL, context TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE TABLE IF NOT EXISTS items (id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS items_created ON items (created);
"""
MAX_LOOKUP = 500  # ids per SELECT, under SQLite's bound on parameters


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    context: list[dict[str, Any]]  # the items it answered (without instructions)


class _Database:
    """One file's connection, used by one thread at a time."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if int(row[0]) != SCHEMA_VERSION:
                raise ConfigError(f"responses database schema {row[0]} is not {SCHEMA_VERSION} "
                                  "(made by another version)")
        except BaseException:
            self.db.close()
            raise


_databases: dict[Path, _Database] = {}
_databases_lock = threading.Lock()


def _database(path: Path) -> _Database:
    with _databases_lock:
        known = _databases.get(path)
        if known is None or not path.exists():  # first use, or the data directory was cleared under us
            if known is not None:
                known.db.close()
            known = _databases[path] = _Database(path)
        return known


class ResponseStore:
    def __init__(self, path: Path, retention_days: float):
        self.path = path
        self.retention_s = retention_days * 86_400.0

    @classmethod
    def of(cls, settings: Settings) -> "ResponseStore":
        return cls(settings.home / "responses" / "responses.sqlite3", settings.responses_retention_days)

    async def save(self, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        await self._run(self._save, response, context)

    async def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or NotFoundError (404) naming `param`."""
        row = await self._run(self._get, response_id)
        if row is None:
            raise not_found(response_id, param)
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    async def items(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored items (of any stored response's context or output) with these ids."""
        return await self._run(self._items, ids)

    async def delete(self, response_id: str) -> None:
        if not await self._run(self._delete, response_id):
            raise not_found(response_id, "response_id")

    # --- in a worker thread ----------------------------------------------------------------
    async def _run(self, fn: Callable[[sqlite3.Connection], T], *args: Any) -> T:
        def locked() -> T:
            database = _database(self.path)
            with database.lock:
                return fn(database.db, *args)

        return await asyncio.to_thread(locked)

    def _cutoff(self) -> float:
        return time.time() - self.retention_s if self.retention_s > 0 else float("-inf")

    def _save(self, db: sqlite3.Connection, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        db.execute("BEGIN IMMEDIATE")  # one transaction: the expired rows go and the new one arrives together
        try:
            now = time.time()
            if self.retention_s > 0:
                db.execute("DELETE FROM responses WHERE created < ?", (self._cutoff(),))
                db.execute("DELETE FROM items WHERE created < ?", (self._cutoff(),))
            db.execute("INSERT OR REPLACE INTO responses (id, created, data, context) VALUES (?, ?, ?, ?)",
                       (response["id"], now, json.dumps(response), json.dumps(context)))
            # Every item by its id, for item_reference: what a later request may point at.
            db.executemany("INSERT OR REPLACE INTO items (id, created, data) VALUES (?, ?, ?)",
                           ((item["id"], now, json.dumps(item)) for item in context + response["output"]))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already (a full disk)
                db.execute("ROLLBACK")
            raise

    def _get(self, db: sqlite3.Connection, response_id: str) -> tuple[str, str] | None:
        return db.execute("SELECT data, context FROM responses WHERE id=? AND created >= ?",
                          (response_id, self._cutoff())).fetchone()

    def _items(self, db: sqlite3.Connection, ids: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for start in range(0, len(ids), MAX_LOOKUP):
            chunk = ids[start:start + MAX_LOOKUP]
            rows = db.execute(f"SELECT id, data FROM items WHERE id IN ({','.join('?' * len(chunk))}) AND created >= ?",
                              (*chunk, self._cutoff())).fetchall()
            found.update((row[0], json.loads(row[1])) for row in rows)
        return found

    def _delete(self, db: sqlite3.Connection, response_id: str) -> bool:
        return db.execute("DELETE FROM responses WHERE id=? AND created >= ?",
                          (response_id, self._cutoff())).rowcount > 0


class PreviousResponseNotFoundError(NotFoundError):
    code = "previous_response_not_found"  # OpenAI's code for an unknown previous_response_id


def not_found(response_id: str, param: str) -> NotFoundError:
    cls = PreviousResponseNotFoundError if param == "previous_response_id" else NotFoundError
    return cls(f"no stored response with id {response_id[:80]!r}", param=param)
