"""`batch submit|list|status|cancel|results`: the Batch API from the terminal, over HTTP.

`submit` uploads a JSONL file, creates the batch, follows it with a progress bar and writes the
results next to the input (`NAME.results.jsonl`, or where `-o` says): the output and error lines
together, in the input's order, so every request of the file has its one line. Ctrl-C stops
following; the batch runs on in the daemon (`batch status`, `batch results` get it later).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..desktop.client import DaemonClient
from ..config.settings import Settings
from ..desktop.daemon import ensure_daemon
from ..errors import InvalidRequestError

FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.5


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("batch", parents=[common], help="OpenAI-style batches of requests (submit, list, ...)")
    sub = p.add_subparsers(dest="batch_command", metavar="ACTION", required=True)
    s = sub.add_parser("submit", parents=[common], help="run a JSONL file of requests as a batch and save the results")
    s.add_argument("file", type=Path, help="JSONL: {custom_id, method: POST, url, body} a line")
    s.add_argument("--model", help="run every line with this model (replaces each body's model)")
    s.add_argument("-o", "--output", type=Path, help="results file (default: next to the input)")
    s.set_defaults(func=cmd_submit)
    s = sub.add_parser("list", parents=[common], help="recent batches")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(func=cmd_list)
    for name, func, text in (("status", cmd_status, "a batch's state and counts (JSON)"),
                             ("cancel", cmd_cancel, "cancel a batch")):
        s = sub.add_parser(name, parents=[common], help=text)
        s.add_argument("id")
        s.set_defaults(func=func)
    s = sub.add_parser("results", parents=[common], help="a finished batch's output and error lines")
    s.add_argument("id")
    s.add_argument("-o", "--output", type=Path, help="write to this file instead of standard output")
    s.set_defaults(func=cmd_results)


def _client(settings: Settings) -> DaemonClient:
    info = ensure_daemon(settings)
    return DaemonClient(info.url, api_key=settings.api_key, timeout=120.0)


def with_model(data: bytes, model: str) -> bytes:
    """Every line's body gets `model`; lines that are not JSON objects are left for the server to report."""
    out = []
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            out.append(raw)
            continue
        if isinstance(line, dict) and isinstance(line.get("body"), dict):
            line["body"]["model"] = model
            raw = json.dumps(line, ensure_ascii=False).encode("utf-8")
        out.append(raw)
    return b"\n".join(out) + b"\n"


def endpoint_of(data: bytes) -> str:
    """The batch's endpoint: the url of the first line that names one."""
    for raw in data.splitlines():
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            continue
        if isinstance(url, str):
            return url
    raise InvalidRequestError("no line of the file names a 'url' (e.g. /v1/chat/completions)")


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    data = args.file.read_bytes()
    if args.model:
        data = with_model(data, args.model)
    client = _client(settings)
    uploaded = client.upload_file(args.file.name, data)
    batch = client.request_json("POST", "/v1/batches", {
        "input_file_id": uploaded["id"], "endpoint": endpoint_of(data), "completion_window": "24h"})
    print(f"Batch {batch['id']} ({batch['request_counts']['total']} requests)", file=sys.stderr)
    while batch["status"] not in FINAL:
        progress(batch)
        time.sleep(POLL_S)
        batch = client.request_json("GET", f"/v1/batches/{batch['id']}")
    progress(batch)
    print(file=sys.stderr)
    out = args.output or args.file.with_name(f"{args.file.stem}.results.jsonl")
    write_results(client, batch, out)
    counts = batch["request_counts"]
    print(f"{batch['status']}: {counts['completed']} done, {counts['failed']} failed -> {out}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def progress(batch: dict[str, Any], width: int = 30) -> None:
    counts = batch["request_counts"]
    total = max(1, counts["total"])
    done = counts["completed"] + counts["failed"]
    bar = "#" * (width * done // total)
    print(f"\r[{bar:<{width}}] {done}/{counts['total']} {batch['status']:<12}", end="", file=sys.stderr, flush=True)


def results(client: DaemonClient, batch: dict[str, Any]) -> list[bytes]:
    """Output and error lines together, in the input's order (their ids end in the line's index)."""
    lines: list[bytes] = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            lines.extend(l for l in client.request_bytes("GET", f"/v1/files/{batch[key]}/content").splitlines() if l)
    return sorted(lines, key=lambda l: int(json.loads(l)["id"].rsplit("_", 1)[1]))


def write_results(client: DaemonClient, batch: dict[str, Any], path: Path | None) -> None:
    data = b"".join(line + b"\n" for line in results(client, batch))
    if path is None:
        sys.stdout.buffer.write(data)
    else:
        path.write_bytes(data)


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    page = _client(settings).request_json("GET", f"/v1/batches?limit={max(1, min(args.limit, 100))}")
    for b in page["data"]:
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))
        print(f"{b['id']}  {b['status']:<11} {c['completed'] + c['failed']:>6}/{c['total']:<6} {created}  {b['endpoint']}")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    print(json.dumps(_client(settings).request_json("GET", f"/v1/batches/{args.id}"), indent=2))
    return 0


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    batch = _client(settings).request_json("POST", f"/v1/batches/{args.id}/cancel")
    print(f"{batch['id']}: {batch['status']}")
    return 0


def cmd_results(args: argparse.Namespace, settings: Settings) -> int:
    client = _client(settings)
    batch = client.request_json("GET", f"/v1/batches/{args.id}")
    if batch["status"] not in FINAL:
        raise InvalidRequestError(f"batch {args.id} is {batch['status']}; results come when it ends")
    write_results(client, batch, args.output)
    return 0
