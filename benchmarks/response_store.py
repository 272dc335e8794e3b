"""Stored Responses benchmark: what a save, a read and a continuation of a stored response cost,
and what a conversation takes on disk.

    python benchmarks/response_store.py [--n 200] [--context-kb 16] [--turns 10] [--turn-kb 512]

1. Times `ResponseStore.save` and `.get` (api/response_store.py: one WAL connection per database
   file, SQL in a worker thread) on a fresh database in a temporary directory, each response
   answering `--context-kb` of input items; and the same rows written and read on a connection
   opened and closed per call, the design the store does not use: closing a WAL database's last
   connection checkpoints it, which is what that row measures.
2. A `previous_response_id` chain of `--turns` turns, each adding `--turn-kb` of input: the bytes
   on disk (database and -wal) against the bytes the turns sent, and what rebuilding the last
   turn's conversation (`resolve`, as a continuation does) costs.

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
from localserve.api.responses_items import new_id  # noqa: E402


def _ms(samples: list[float]) -> str:
    p90 = sorted(samples)[int(len(samples) * 0.9)]
    return f"median {statistics.median(samples) * 1000:.2f} ms, p90 {p90 * 1000:.2f} ms"


def _items(kb: int) -> list[dict]:
    return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": "x" * 1024}]} for _ in range(kb)]


def _response(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response",
            "output": [{"id": new_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]}


async def shared(path: Path, n: int, kb: int) -> tuple[list[float], list[float]]:
    store = ResponseStore(path, 30)
    saves, gets = [], []
    for i in range(n):
        inputs = _items(kb)
        t0 = time.perf_counter()
        await store.save(_response(i), None, inputs)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await store.get(f"resp_{i}")
        gets.append(time.perf_counter() - t0)
    return saves, gets


def per_call(path: Path, n: int, kb: int) -> tuple[list[float], list[float]]:
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
                   (f"resp_{i}", time.time(), json.dumps(_response(i)), json.dumps(_items(kb))))
        db.close()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        db = connect()
        db.execute("SELECT data, context FROM responses WHERE id=?", (f"resp_{i}",)).fetchone()
        db.close()
        gets.append(time.perf_counter() - t0)
    return saves, gets


async def chain(path: Path, turns: int, kb: int) -> tuple[int, int, float]:
    """(bytes sent, bytes on disk, seconds to rebuild the last turn's conversation)."""
    store = ResponseStore(path, 30)
    sent, previous = 0, None
    for i in range(turns):
        inputs = [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                   "content": [{"type": "input_text", "text": "y" * (kb * 1024)}]}]
        sent += len(json.dumps(inputs))
        await store.save(_response(i), previous, inputs)
        previous = f"resp_{i}"
    t0 = time.perf_counter()
    await store.resolve(previous, [], 1 << 30)
    rebuild = time.perf_counter() - t0
    disk = sum(path.with_name(path.name + suffix).stat().st_size for suffix in ("", "-wal"))
    return sent, disk, rebuild


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="responses saved and read back")
    parser.add_argument("--context-kb", type=int, default=16, help="size of each response's input items")
    parser.add_argument("--turns", type=int, default=10, help="turns of the previous_response_id chain")
    parser.add_argument("--turn-kb", type=int, default=512, help="input each turn of the chain adds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        saves, gets = asyncio.run(shared(Path(tmp) / "shared" / "responses.sqlite3", args.n, args.context_kb))
        print(f"ResponseStore (one connection): save {_ms(saves)}; get {_ms(gets)}")
        saves, gets = per_call(Path(tmp) / "per_call.sqlite3", args.n, args.context_kb)
        print(f"a connection per call:          save {_ms(saves)}; get {_ms(gets)}")
        sent, disk, rebuild = asyncio.run(chain(Path(tmp) / "chain" / "responses.sqlite3", args.turns, args.turn_kb))
        print(f"a {args.turns}-turn chain of {args.turn_kb} KiB turns: {sent / 2**20:.1f} MiB sent, "
              f"{disk / 2**20:.1f} MiB on disk (db + wal, x{disk / sent:.2f}); "
              f"rebuilding the last turn {rebuild * 1000:.1f} ms")


if __name__ == "__main__":
    main()
