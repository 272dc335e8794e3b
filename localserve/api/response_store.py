"""Stored Responses API objects (`store`, the default): SQLite in the data directory.

What a later request needs of a stored response: the response object itself (GET
/v1/responses/{id}) and the conversation it answered, as Responses items (`context`: the previous
response's context and output, then this request's input), so `previous_response_id` rebuilds the
whole conversation, token for token the prompt the previous turn ended with, and the prefix cache
serves it.

The approach is batches/store.py's: stdlib sqlite3 in WAL mode with synchronous=NORMAL, so a
recorded response survives a killed daemon, its SQL in a worker thread off the event loop. It sits
in api/ rather than beside batches/ because the endpoint that reads and writes it (api/responses.py)
is below batches/ (which runs /v1/responses lines through it too), and store/ is the model cache.
Unlike the batch store, it keeps no connection open: each call opens its own (a fraction of a
millisecond against a model's answer), so the HTTP routes and the Batch API runner need no shared
object and nothing has to be closed; SQLite serialises their writes (busy timeout).

Retention (`responses_retention_days`) is lazy: every write deletes what has expired, and a read
never returns an expired response even before that.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.settings import Settings
from ..errors import ConfigError, NotFoundError

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL, context TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""
_ready: set[Path] = set()  # databases whose schema this process has checked
_ready_lock = threading.Lock()


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    context: list[dict[str, Any]]  # the items it answered (without instructions)


class ResponseStore:
    def __init__(self, path: Path, retention_days: float):
        self.path = path
        self.retention_s = retention_days * 86_400.0

    @classmethod
    def of(cls, settings: Settings) -> "ResponseStore":
        return cls(settings.home / "responses" / "responses.sqlite3", settings.responses_retention_days)

    async def save(self, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self._save, response, context)

    async def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or NotFoundError (404) naming `param`."""
        return await asyncio.to_thread(self._get, response_id, param)

    async def delete(self, response_id: str) -> None:
        await asyncio.to_thread(self._delete, response_id)

    # --- in a worker thread ----------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        with _ready_lock:
            fresh = self.path not in _ready
            if fresh:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            if fresh:
                try:
                    self._init(db)
                except BaseException:
                    db.close()
                    raise
                _ready.add(self.path)
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    @staticmethod
    def _init(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")  # kept in the file: later connections inherit it
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise ConfigError(f"responses database schema {row[0]} is not {SCHEMA_VERSION} (made by another version)")

    def _cutoff(self) -> float:
        return time.time() - self.retention_s if self.retention_s > 0 else float("-inf")

    def _save(self, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        db = self._connect()
        try:
            with db:  # one transaction: the expired rows go and the new one arrives together
                db.execute("BEGIN IMMEDIATE")
                if self.retention_s > 0:
                    db.execute("DELETE FROM responses WHERE created < ?", (self._cutoff(),))
                db.execute("INSERT OR REPLACE INTO responses (id, created, data, context) VALUES (?, ?, ?, ?)",
                           (response["id"], time.time(), json.dumps(response), json.dumps(context)))
        finally:
            db.close()

    def _get(self, response_id: str, param: str) -> StoredResponse:
        db = self._connect()
        try:
            row = db.execute("SELECT data, context FROM responses WHERE id=? AND created >= ?",
                             (response_id, self._cutoff())).fetchone()
        finally:
            db.close()
        if row is None:
            raise not_found(response_id, param)
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, response_id: str) -> None:
        db = self._connect()
        try:
            with db:
                deleted = db.execute("DELETE FROM responses WHERE id=? AND created >= ?",
                                     (response_id, self._cutoff())).rowcount
        finally:
            db.close()
        if not deleted:
            raise not_found(response_id, "response_id")


class PreviousResponseNotFoundError(NotFoundError):
    code = "previous_response_not_found"  # OpenAI's code for an unknown previous_response_id


def not_found(response_id: str, param: str) -> NotFoundError:
    cls = PreviousResponseNotFoundError if param == "previous_response_id" else NotFoundError
    return cls(f"no stored response with id {response_id[:80]!r}", param=param)
