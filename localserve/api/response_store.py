"""Stored Responses API objects (`store`, the default): SQLite in the data directory.

What a later request needs of a stored response: the response object (GET /v1/responses/{id}),
the conversation it answered (GET .../input_items, and `previous_response_id`, which rebuilds it
token for token so the prefix cache serves it), and its items by id (`item_reference`).

Storage grows with what clients sent, never with references to it (security review 4, findings 1
and 3). Each item is stored once, by the response whose request or answer brought it (`items`,
keyed by that response and the item's id, so one response's ids never touch another's). A
response row holds its own object, a link to its `previous` response, and its input as a list of
item numbers (`inputs`): an `item_reference` or a continuation adds a few bytes, not a copy.
Rebuilding a conversation walks the links (one recursive query, in the worker thread, with the
JSON parsed there too), within a byte budget: references may resolve to at most `max_body_bytes`
(what the request could have sent itself), a chain to at most CHAIN_BODIES times that (more text
than any model's context holds).

Deleting (or expiring) a response does not break the others, as OpenAI's store behaves: it is no
longer served, its item ids no longer resolve for `item_reference`, and `previous_response_id` of
it is a 404; what only it held is removed at once (`secure_delete`, then a WAL checkpoint, so the
text leaves the database and its -wal file); what a live response still needs (a descendant's
conversation runs through it, or another response referenced its items) stays until that one
goes, with the deleted response's own object blanked.

An `item_reference` resolves, first, to an item of the conversation `previous_response_id`
continues (its latest with that id), then to the item with that id that a served response stored
first: a client re-sending an id it got from us, or another client choosing the same id, never
changes what the id already named (finding 11).

The approach is batches/store.py's: stdlib sqlite3 in WAL mode with synchronous=NORMAL, so a
recorded response survives a killed daemon, one connection used under a lock, its SQL in a worker
thread off the event loop. It sits in api/ rather than beside batches/ because the endpoint that
reads and writes it (api/responses.py) is below batches/ (which runs /v1/responses lines through
it too), and store/ is the model cache. The connection belongs to the database file, not to an
app: `ResponseStore.of(settings)` is a plain value that the HTTP routes and the Batch API runner
make alike, and the first call opens the file's connection for the process. A connection per call
would need nothing shared, but closing a WAL database's last connection checkpoints it
(benchmarks/response_store.py measures both).

Retention (`responses_retention_days`) is lazy: every write removes what has expired (as a delete
would), and a read never serves an expired response even before that.

Schema 1 (each row a full copy of its conversation) is reset, not migrated: the store is a cache
of conversations that clients continue for minutes to days, and its quadratic copies are what this
schema exists to be rid of. A schema-1 file is emptied and vacuumed on first open; a newer schema
(a later localserve) is left alone and every request answers that it cannot be read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..config.settings import Settings
from ..errors import ConfigError, InvalidRequestError, NotFoundError

SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 10.0
PAGE_SIZE = 1024
CHAIN_BODIES = 8  # a previous_response_id chain may hold this many max_body_bytes of items
MAX_LOOKUP = 500  # ids per SELECT, under SQLite's bound on parameters
T = TypeVar("T")

# `n` numbers: rows refer to each other by integer, so a reference costs bytes, not the item.
# The foreign keys are a net under _collect: a row another still needs cannot be deleted.
_SCHEMA = """
CREATE TABLE responses (
    n INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, created REAL NOT NULL,
    previous INTEGER REFERENCES responses (n),
    live INTEGER NOT NULL,        -- 0: deleted, kept only for what other responses need of it
    data TEXT NOT NULL);          -- the response object, its output left out (they are items)
CREATE INDEX responses_created ON responses (created);
CREATE INDEX responses_previous ON responses (previous);
CREATE TABLE items (
    n INTEGER PRIMARY KEY, owner INTEGER NOT NULL REFERENCES responses (n), id TEXT NOT NULL,
    output INTEGER NOT NULL, size INTEGER NOT NULL, data TEXT NOT NULL, UNIQUE (owner, id));
CREATE INDEX items_id ON items (id);
CREATE TABLE inputs (
    response INTEGER NOT NULL REFERENCES responses (n), position INTEGER NOT NULL,
    item INTEGER NOT NULL REFERENCES items (n), PRIMARY KEY (response, position)) WITHOUT ROWID;
CREATE INDEX inputs_item ON inputs (item);
"""

# A response's conversation, oldest first: each ancestor's input and output, then its own input
# (and its output with ?2 = 0). ?1 is the response's n.
_CHAIN = """
WITH RECURSIVE chain (n, depth) AS (
    SELECT ?1, 0
    UNION ALL
    SELECT r.previous, chain.depth + 1 FROM responses r JOIN chain ON r.n = chain.n WHERE r.previous IS NOT NULL)
SELECT {columns} FROM (
    SELECT chain.depth AS depth, 0 AS part, p.position AS position, p.item AS item
        FROM chain JOIN inputs p ON p.response = chain.n
    UNION ALL
    SELECT chain.depth, 1, o.n, o.n FROM chain JOIN items o ON o.owner = chain.n AND o.output = 1
        WHERE chain.depth >= ?2
) AS c JOIN items i ON i.n = c.item
ORDER BY c.depth DESC, c.part, c.position
"""


@dataclass
class StoredItem:
    n: int  # its row: what a new response's input list records when it refers to it
    item: dict[str, Any]
    size: int  # bytes of its JSON, counted against the budgets


@dataclass
class Resolved:
    history: list[StoredItem]  # the previous response's conversation and output, oldest first
    references: dict[str, StoredItem]  # each resolvable referenced id's item


class _Database:
    """One file's connection, used by one thread at a time."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()
        try:
            # Small pages (on a new file; an existing one keeps its own): every commit appends a
            # page of each table and index it touches to the -wal file. A 10-turn chain left on
            # disk (db + wal) x12.4 what it sent with 4 KiB pages and x4.0 with 1 KiB ones at 4 KiB
            # turns, x1.97 and x1.28 at 50 KiB turns (benchmarks/response_store.py --turn-kb);
            # overflow text loses 0.4% to a 1 KiB page.
            self.db.execute(f"PRAGMA page_size={PAGE_SIZE}")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.execute("PRAGMA secure_delete=ON")  # deleted text is zeroed, not left in free pages
            self._schema()
        except BaseException:
            self.db.close()
            raise

    def _schema(self) -> None:
        db = self.db
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        version = int(row[0]) if row else 0
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise ConfigError(f"responses database schema {version} is newer than {SCHEMA_VERSION} "
                              "(made by a later localserve)")
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name != 'meta'")]
        with _transaction(db):
            for table in tables:  # schema 1, or a file cut short before its version was written
                db.execute(f'DROP TABLE "{table}"')
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        if tables:
            db.execute("VACUUM")  # the old copies leave the file, not only its pages
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


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
        return cls(settings.responses_dir / "responses.sqlite3", settings.responses_retention_days)

    async def save(self, response: dict[str, Any], previous_id: str | None,
                   inputs: Sequence[dict[str, Any] | StoredItem]) -> None:
        """Store an answered response: its object and output, a link to `previous_id`, and its
        input (new items stored, stored ones by number)."""
        await self._run(self._save, response, previous_id, inputs)

    async def get(self, response_id: str, param: str = "response_id") -> dict[str, Any]:
        """The stored response object, or NotFoundError (404) naming `param`."""
        return await self._run(self._get, response_id, param)

    async def resolve(self, previous_id: str | None, references: list[str], budget: int) -> Resolved:
        """The conversation `previous_id` continues (404 if it is not served) and the stored items
        `references` name; 400 if those resolve to more than `budget` bytes (each reference
        counted), or the conversation to more than CHAIN_BODIES times it."""
        return await self._run(self._resolve, previous_id, references, budget)

    async def input_items(self, response_id: str, descending: bool, limit: int,
                          after: str | None) -> tuple[list[dict[str, Any]], bool]:
        """One page of the items a stored response answered (its ancestors' included), and whether
        more follow; `after` an item id of the conversation (400 if none)."""
        return await self._run(self._input_items, response_id, descending, limit, after)

    async def delete(self, response_id: str) -> None:
        if not await self._run(self._delete, response_id):
            raise not_found(response_id, "response_id")

    # --- in a worker thread ----------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        def locked() -> T:
            database = _database(self.path)
            with database.lock:
                return fn(database.db, *args)

        return await asyncio.to_thread(locked)

    def _cutoff(self) -> float:
        return time.time() - self.retention_s if self.retention_s > 0 else float("-inf")

    def _served(self, db: sqlite3.Connection, response_id: str) -> int | None:
        row = db.execute("SELECT n FROM responses WHERE id=? AND live=1 AND created >= ?",
                         (response_id, self._cutoff())).fetchone()
        return row[0] if row else None

    def _save(self, db: sqlite3.Connection, response: dict[str, Any], previous_id: str | None,
              inputs: Sequence[dict[str, Any] | StoredItem]) -> None:
        with _transaction(db):
            previous = None
            if previous_id is not None:  # deleted while this answer ran, and nothing kept it: a 404
                row = db.execute("SELECT n FROM responses WHERE id=?", (previous_id,)).fetchone()
                if row is None:
                    raise not_found(previous_id, "previous_response_id")
                previous = row[0]
            data = json.dumps({**response, "output": []})  # the output is stored as items, below
            n = db.execute("INSERT INTO responses (id, created, previous, live, data) VALUES (?, ?, ?, 1, ?)",
                           (response["id"], time.time(), previous, data)).lastrowid
            rows = []
            for position, entry in enumerate(inputs):
                rows.append((n, position, entry.n if isinstance(entry, StoredItem) else _insert(db, n, entry, 0)))
            try:
                db.executemany("INSERT INTO inputs (response, position, item) VALUES (?, ?, ?)", rows)
            except sqlite3.IntegrityError:  # a referenced item's last holder went while this answer ran
                raise InvalidRequestError("an item this request referenced was deleted while it was answered",
                                          param="input") from None
            for item in response["output"]:
                _insert(db, n, item, 1)
            # After the new row: its link keeps the conversation it continues.
            removed = self._collect(db, {r[0] for r in db.execute("SELECT n FROM responses WHERE created < ?",
                                                                     (self._cutoff(),))})
        if removed:
            _checkpoint(db)

    def _get(self, db: sqlite3.Connection, response_id: str, param: str) -> dict[str, Any]:
        with _transaction(db, "BEGIN"):
            n = self._served(db, response_id)
            if n is None:
                raise not_found(response_id, param)
            response = json.loads(db.execute("SELECT data FROM responses WHERE n=?", (n,)).fetchone()[0])
            response["output"] = [json.loads(r[0]) for r in
                                  db.execute("SELECT data FROM items WHERE owner=? AND output=1 ORDER BY n", (n,))]
        return response

    def _resolve(self, db: sqlite3.Connection, previous_id: str | None, references: list[str],
                 budget: int) -> Resolved:
        with _transaction(db, "BEGIN"):  # one snapshot: a chain is never read half-deleted
            history: list[StoredItem] = []
            if previous_id is not None:
                n = self._served(db, previous_id)
                if n is None:
                    raise not_found(previous_id, "previous_response_id")
                history = _read_chain(db, n, CHAIN_BODIES * budget)
            found = {s.item["id"]: s for s in history}  # the conversation's own, its latest of an id
            sizes = {item_id: found[item_id].size for item_id in set(references) if item_id in found}
            numbers = self._first_stored(db, [i for i in set(references) if i not in found], sizes)
            total = sum(sizes.get(item_id, 0) for item_id in references)
            if total > budget:
                raise InvalidRequestError(f"'input': its item references resolve to {total} bytes, more than "
                                          f"{budget} (setting max_body_bytes)", param="input")
            for item_id, n in numbers.items():
                found[item_id] = StoredItem(n, _item(db, n), sizes[item_id])
        return Resolved(history, {item_id: found[item_id] for item_id in references if item_id in found})

    def _first_stored(self, db: sqlite3.Connection, ids: list[str], sizes: dict[str, int]) -> dict[str, int]:
        """Each id's item (its row number) that a served response stored first; sizes filled in."""
        numbers: dict[str, int] = {}
        for start in range(0, len(ids), MAX_LOOKUP):
            chunk = ids[start:start + MAX_LOOKUP]
            # SQLite gives a bare column the values of the row min() chose.
            for item_id, n, size in db.execute(
                    f"SELECT i.id, min(i.n), i.size FROM items i JOIN responses r ON r.n = i.owner "
                    f"WHERE i.id IN ({','.join('?' * len(chunk))}) AND r.live = 1 AND r.created >= ? GROUP BY i.id",
                    (*chunk, self._cutoff())):
                numbers[item_id], sizes[item_id] = n, size
        return numbers

    def _input_items(self, db: sqlite3.Connection, response_id: str, descending: bool, limit: int,
                     after: str | None) -> tuple[list[dict[str, Any]], bool]:
        with _transaction(db, "BEGIN"):
            n = self._served(db, response_id)
            if n is None:
                raise not_found(response_id, "response_id")
            rows = db.execute(_CHAIN.format(columns="i.n, i.id"), (n, 1)).fetchall()  # numbers only
            if descending:
                rows.reverse()
            if after is not None:
                ids = [row[1] for row in rows]
                if after not in ids:
                    raise InvalidRequestError(f"'after' names no item of this response ({after[:80]!r})",
                                              param="after")
                rows = rows[ids.index(after) + 1:]
            page = [_item(db, row[0]) for row in rows[:limit]]
        return page, len(rows) > limit

    def _delete(self, db: sqlite3.Connection, response_id: str) -> bool:
        with _transaction(db):
            n = self._served(db, response_id)
            if n is None:
                return False
            db.execute("UPDATE responses SET live=0, data='' WHERE n=?", (n,))
            self._collect(db, {n})
        _checkpoint(db)
        return True

    def _collect(self, db: sqlite3.Connection, candidates: set[int]) -> int:
        """Remove what of these (and, in turn, of their ancestors and the responses they referred
        to) no served response needs; the rows removed."""
        cutoff, removed = self._cutoff(), 0
        while candidates:
            n = candidates.pop()
            row = db.execute("SELECT previous, live, created FROM responses WHERE n=?", (n,)).fetchone()
            if row is None or (row[1] and row[2] >= cutoff):
                continue  # gone already, or still served
            if db.execute("SELECT 1 FROM responses WHERE previous=? LIMIT 1", (n,)).fetchone() is None:
                # No conversation runs through it: its input list goes, and so do its items no
                # other response refers to.
                referred = {r[0] for r in db.execute("SELECT DISTINCT i.owner FROM inputs p JOIN items i ON "
                                                     "i.n = p.item WHERE p.response=? AND i.owner != ?", (n, n))}
                removed += db.execute("DELETE FROM inputs WHERE response=?", (n,)).rowcount
                removed += db.execute("DELETE FROM items WHERE owner=? AND NOT EXISTS "
                                      "(SELECT 1 FROM inputs p WHERE p.item = items.n)", (n,)).rowcount
                candidates |= referred
                if db.execute("SELECT 1 FROM items WHERE owner=? LIMIT 1", (n,)).fetchone() is None:
                    db.execute("DELETE FROM responses WHERE n=?", (n,))
                    removed += 1
                    if row[0] is not None:
                        candidates.add(row[0])
                    continue
            # Kept for others, never served again: its own object need not stay.
            removed += db.execute("UPDATE responses SET data='' WHERE n=? AND data != ''", (n,)).rowcount
        return removed


def _insert(db: sqlite3.Connection, owner: int, item: dict[str, Any], output: int) -> int:
    data = json.dumps(item)
    return db.execute("INSERT INTO items (owner, id, output, size, data) VALUES (?, ?, ?, ?, ?)",
                      (owner, item["id"], output, len(data), data)).lastrowid


def _read_chain(db: sqlite3.Connection, n: int, budget: int) -> list[StoredItem]:
    """Response n's conversation and output, parsed; a 400 past `budget` bytes, before any text
    is read. The order comes first, numbers only (a sort that carried the text would copy it)."""
    order = db.execute(_CHAIN.format(columns="i.n, i.size"), (n, 0)).fetchall()
    total = sum(size for _, size in order)
    if total > budget:
        raise InvalidRequestError(f"'previous_response_id': the stored conversation is {total} bytes, more than "
                                  f"{budget}", param="previous_response_id")
    parsed: dict[int, dict[str, Any]] = {}
    for item_n, _ in order:  # an item the conversation refers to twice is parsed once
        if item_n not in parsed:
            parsed[item_n] = _item(db, item_n)
    return [StoredItem(item_n, parsed[item_n], size) for item_n, size in order]


def _item(db: sqlite3.Connection, n: int) -> dict[str, Any]:
    return json.loads(db.execute("SELECT data FROM items WHERE n=?", (n,)).fetchone()[0])


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[None]:
    """BEGIN ... COMMIT, or ROLLBACK on any error (SQLite may have rolled back already: a full disk)."""
    db.execute(begin)
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _checkpoint(db: sqlite3.Connection) -> None:
    """Deleted text leaves the -wal file too: its frames are copied back and the file emptied."""
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


class PreviousResponseNotFoundError(NotFoundError):
    code = "previous_response_not_found"  # OpenAI's code for an unknown previous_response_id


def not_found(response_id: str, param: str) -> NotFoundError:
    cls = PreviousResponseNotFoundError if param == "previous_response_id" else NotFoundError
    return cls(f"no stored response with id {response_id[:80]!r}", param=param)
