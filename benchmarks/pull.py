"""Pull benchmark: how fast the puller moves and verifies bytes, with the network taken out.

    python benchmarks/pull.py [--size-mb 512] [--drop-every-mb 0]

Serves a random payload from a local aiohttp server and times `pull_model` of it (download to the
`.partial`, sha256 verification, atomic rename, manifest), the download alone, and sha256 over the
finished file. With --drop-every-mb N the server cuts the connection every N MB, so the figure
includes the resume cost (a new request with Range per drop).

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localserve.config.settings import load_settings, replace  # noqa: E402
from localserve.pull import RetryPolicy, download_file, pull_model  # noqa: E402
from localserve.store.verify import sha256_file  # noqa: E402


def serve(payload: bytes, drop_every: int) -> tuple[str, dict[str, int]]:
    stats = {"requests": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        stats["requests"] += 1
        start = int(request.headers.get("Range", "bytes=0-").split("=")[1].split("-")[0])
        status = 206 if start else 200
        headers = {"Content-Length": str(len(payload) - start)}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(payload) - 1}/{len(payload)}"
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        end = len(payload) if not drop_every else min(len(payload), start + drop_every)
        view = memoryview(payload)
        for position in range(start, end, 1 << 20):
            await response.write(view[position:min(end, position + (1 << 20))])
        if end < len(payload):
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []

    async def start() -> None:
        app = web.Application()
        app.router.add_get("/model.gguf", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ready.set()

    def run() -> None:
        loop.run_until_complete(start())
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{port[0]}/model.gguf", stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--drop-every-mb", type=int, default=0, help="cut the connection every N MB (0: never)")
    args = parser.parse_args()

    size = args.size_mb * 1_000_000
    payload = os.urandom(size)
    digest = hashlib.sha256(payload).hexdigest()
    url, stats = serve(payload, args.drop_every_mb * 1_000_000)
    retry = RetryPolicy(attempts=5, backoff=0.0, max_backoff=0.0)

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        catalog = home / "catalog.json"
        catalog.write_text(json.dumps({"models": {"bench": {"variants": {"Q4_0": {
            "quant": "Q4_0", "sha256": digest, "size": size, "file": "model.gguf", "sources": [url]}}}}}))
        settings = replace(load_settings(flags={"home": str(home)}, environ={}, config_path=home / "none"),
                           catalog=catalog)

        t0 = time.perf_counter()
        model = pull_model("bench", settings, retry=retry)
        pull_s = time.perf_counter() - t0
        pull_requests = stats["requests"]

        t0 = time.perf_counter()
        assert sha256_file(model.path) == digest
        sha_s = time.perf_counter() - t0

        stats["requests"] = 0
        t0 = time.perf_counter()
        download_file(url, home / "again.partial", expected_size=size, retry=retry)
        download_s = time.perf_counter() - t0

    mb = size / 1e6
    print(f"payload {mb:.0f} MB, connection dropped every {args.drop_every_mb or '-'} MB")
    print(f"pull_model (download + sha256 + rename + manifest): {pull_s:6.2f} s  {mb / pull_s:7.1f} MB/s  "
          f"({pull_requests} HTTP requests)")
    print(f"download only:                                     {download_s:6.2f} s  {mb / download_s:7.1f} MB/s  "
          f"({stats['requests']} HTTP requests)")
    print(f"sha256 of the finished file:                       {sha_s:6.2f} s  {mb / sha_s:7.1f} MB/s")


if __name__ == "__main__":
    main()
