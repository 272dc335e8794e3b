"""Stored Responses benchmark: what a save and a read of a stored response cost.

    python benchmarks/response_store.py [--n 200] [--context-kb 16]

Times `ResponseStore.save` and `.get` (api/response_store.py: one WAL connection per database file,
SQL in a worker thread) on a fresh database in a temporary directory, and the same statements on a
connection opened and closed per call, the design the store does not use: closing a WAL
database's last connection checkpoints it, which is what the second row measures.

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localserve.api.response_store import ResponseStore  # noqa: E402


def _ms(samples: list[float]) -> str:
    p90 = sorted(samples)[int(len(samples) * 0.9)]
    return f"median {statistics.median(samples) * 1000:.2f} ms, p90 {p90 * 1000:.2f} ms"


async def shared(path: Path, n: int, context: list[dict]) -> tuple[list[float], list[float]]:
    store = ResponseStore(path, 30)
    saves, gets = [], []
    for i in range(n):
        t0 = time.perf_counter()
        await store.save({"id": f"resp_{i}", "object": "response"}, context)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await store.get(f"resp_{i}")
        gets.append(time.perf_counter() - t0)
    return saves, gets


def per_call(path: Path, n: int, context: list[dict]) -> tuple[list[float], list[float]]:
    def connect() -> sqlite3.Connection:
        db = sqlite3.connect(str(path), isolation_level=None)
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    db = connect()
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, created REAL, data TEXT, context TEXT)")
    db.close()
    saves, gets = [], []
    for i in range(n):
        t0 = time.perf_counter()
        db = connect()
        db.execute("INSERT INTO responses VALUES (?, ?, ?, ?)",
                   (f"resp_{i}", time.time(), json.dumps({"id": f"resp_{i}"}), json.dumps(context)))
        db.close()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        db = connect()
        db.execute("SELECT data, context FROM responses WHERE id=?", (f"resp_{i}",)).fetchone()
        db.close()
        gets.append(time.perf_counter() - t0)
    return saves, gets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="responses saved and read back")
    parser.add_argument("--context-kb", type=int, default=16, help="size of each response's stored context")
    args = parser.parse_args()
    context = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 1024}]}
               for _ in range(args.context_kb)]
    with tempfile.TemporaryDirectory() as tmp:
        saves, gets = asyncio.run(shared(Path(tmp) / "shared" / "responses.sqlite3", args.n, context))
        print(f"ResponseStore (one connection): save {_ms(saves)}; get {_ms(gets)}")
        saves, gets = per_call(Path(tmp) / "per_call.sqlite3", args.n, context)
        print(f"a connection per call:          save {_ms(saves)}; get {_ms(gets)}")


if __name__ == "__main__":
    main()
