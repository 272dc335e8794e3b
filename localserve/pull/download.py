"""Resumable HTTP download onto a `.partial` file.

Rules this module keeps, each guarding a real failure:
- Resume sends `Range: bytes=<have>-` and appends only when the server answers 206 with a
  Content-Range that starts exactly at <have>. A server (or proxy) that ignores Range answers 200
  with the whole body: appending that would silently corrupt the file, so the partial is truncated
  and the download restarts from byte 0.
- A connection that drops mid-body (reset, timeout, body shorter than Content-Length) is retried
  with exponential backoff; a retry that made progress resets the failure count, so a slow, flaky
  link still finishes while a dead one fails after `attempts` tries in a row.
- 401/403/404/410 are final (retrying will not change them); 429 and 5xx are retried.
- ENOSPC (or EFBIG) while writing raises DiskFullError and keeps the partial, resumable once
  space is freed.
- Ctrl-C (KeyboardInterrupt) propagates untouched; the file is closed by `with`, so the partial
  holds exactly the bytes received and the next pull resumes from there.
- A body that sends nothing for the stall timeout (the socket timeout) is a final error, not a
  retry: the partial stays for a later pull. Cancellation (CancelToken) stops the transfer at once.
- Free disk is checked again as bytes arrive (a body of unknown length was never checked ahead),
  and a failed download from a server that cannot resume (no `Accept-Ranges: bytes`) removes its
  partial: nothing could ever continue it.
- Messages name the host, never a port or the errno text: /api/pull relays them to clients, and
  "connection refused" against a local port tells a caller which ports are open.

The transport (transport.py) is injectable (`Transport.open`), but tests run it against real
local HTTP servers.
"""

from __future__ import annotations

import errno
import http.client
import json
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from ..errors import DiskFullError, DownloadError, HTTPStatusError, NetworkError
from .cancel import CancelToken
from ..protocol.progress import Progress, emit
from .transport import BearerTransport, Response, Transport, UrllibTransport, origin_of  # noqa: F401 (re-exported)

CHUNK = 1024 * 1024
DISK_CHECK_EVERY = 16 * 1024 * 1024  # bytes between free-space checks while writing
FINAL_STATUSES = {401: "unauthorized (the repository may be gated or private)", 403: "forbidden",
                  404: "not found", 410: "gone"}
# Errors that mean "the network hiccuped", as opposed to our own disk failing.
NETWORK_ERRORS = (OSError, http.client.HTTPException, socket.timeout)


@dataclass
class RetryPolicy:
    attempts: int = 5  # consecutive failures without progress before giving up
    backoff: float = 0.5  # first wait; doubles each failure
    max_backoff: float = 8.0

    def wait(self, failures: int, retry_after: str | None = None, cancel: CancelToken | None = None) -> None:
        delay = min(self.max_backoff, self.backoff * (2 ** max(0, failures - 1)))
        if retry_after and retry_after.isdigit():
            delay = min(self.max_backoff, max(delay, float(retry_after)))
        if cancel is not None:
            cancel.wait(delay)
        else:
            time.sleep(delay)


def host_of(url: str) -> str:
    return urlparse(url).hostname or url


def status_error(url: str, status: int, tries: int = 0) -> HTTPStatusError:
    reason = FINAL_STATUSES.get(status) or ("server error" if status >= 500 else "unexpected response")
    after = f" after {tries} tries" if tries > 1 else ""
    return HTTPStatusError(f"HTTP {status} {reason} from {host_of(url)} ({Path(urlparse(url).path).name}){after}", status)


def describe_network_error(e: BaseException) -> str:
    """A coarse reason: never urllib's or the OS's text, which carries errno names and addresses."""
    reason = getattr(e, "reason", e)
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(reason, socket.gaierror):
        return "host name not resolved"
    return "connection failed"


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def parse_content_range(value: str | None) -> tuple[int, int | None] | None:
    """(first byte, total size or None) of a 206 Content-Range header."""
    match = _CONTENT_RANGE.match(value or "")
    if not match:
        return None
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total


DISK_MARGIN = 64 * 1024 * 1024  # leave room for manifests, logs and the OS (pull_min_free_disk)


def ensure_free_space(directory: Path, need: int, what: str, margin: int = DISK_MARGIN) -> None:
    """Refuse to start writing `need` bytes that cannot fit (a full disk breaks more than our pull)."""
    free = shutil.disk_usage(directory).free
    if free < need + margin:
        raise DiskFullError(f"not enough disk space for {what}: needs {_human(need + margin)}, {_human(free)} free")


def _check_running_space(directory: Path, what: str, margin: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < margin:
        raise DiskFullError(f"disk space ran low while downloading {what} ({_human(free)} free, "
                            f"pull_min_free_disk is {_human(margin)}); free some space and pull again to resume")


def write_chunk(f: BinaryIO, chunk: bytes, what: str, *, resumable: bool) -> None:
    """`f.write(chunk)`, with "no space" write errors turned into DiskFullError. EFBIG is the same
    story on file systems with a file size limit (a 4.7 GB model onto a FAT32 drive) or under a
    file-size rlimit. Every writer of model bytes (download, wheel unpacking, joining parts) uses it."""
    try:
        f.write(chunk)
    except OSError as e:
        hint = "; free some space and pull again to resume" if resumable else ""
        if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise DiskFullError(f"disk full while writing {what}{hint}") from None
        if e.errno == errno.EFBIG:
            raise DiskFullError(f"the file system cannot hold {what} (file too large for it)") from None
        raise


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _truncate(path: Path) -> None:
    with open(path, "wb"):
        pass


@dataclass
class DownloadLimits:
    """What bounds one download: the stall timeout (for its message: the transport's socket
    timeout enforces it), the free disk to keep, and the token that cancels it."""

    stall_timeout: float | None = None
    min_free: int = DISK_MARGIN
    cancel: CancelToken | None = None


def download_file(
    url: str,
    partial: Path,
    *,
    expected_size: int | None = None,
    part: str | None = None,
    progress: Progress = None,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
    limits: DownloadLimits | None = None,
) -> int:
    """Bring `partial` to the full body of `url`, resuming what is there. Returns its size."""
    limits = limits or DownloadLimits()
    transport = transport or UrllibTransport(limits.stall_timeout or 30.0, cancel=limits.cancel)
    part = part or partial.name
    attempts = _Attempts(retry or RetryPolicy(), url, f"download of {part} from {host_of(url)}", progress, part,
                         limits.cancel)
    state = _Transfer(url, partial, part, progress, limits, attempts)
    try:
        return state.run(transport, expected_size)
    except Exception:
        if state.resumable is False:
            partial.unlink(missing_ok=True)  # the server cannot continue it: the bytes are dead weight
        raise


class _Transfer:
    """One download_file call: its retry loop and the body copy of each attempt."""

    def __init__(self, url: str, partial: Path, part: str, progress: Progress, limits: DownloadLimits,
                 attempts: "_Attempts"):
        self.url, self.partial, self.part, self.progress, self.limits = url, partial, part, progress, limits
        self.attempts = attempts
        self.resumable: bool | None = None  # unknown until a server answers
        self.best = 0  # the most bytes any attempt reached: only going past it is progress

    def _progressed(self, have: int) -> None:
        """Reset the failure count when this attempt got further than any before. A server that
        cannot resume restarts from byte 0 each time; counting that as progress would retry forever."""
        if have > self.best:
            self.best = have
            self.attempts.progressed()

    def _check_cancel(self) -> None:
        if self.limits.cancel is not None:
            self.limits.cancel.check()

    def run(self, transport: Transport, expected_size: int | None) -> int:
        url, partial, part, progress, fail = self.url, self.partial, self.part, self.progress, self.attempts.fail
        while True:
            self._check_cancel()
            have = partial.stat().st_size if partial.exists() else 0
            if expected_size is not None and have > expected_size:
                _truncate(partial)  # longer than the real file: cannot be a prefix of it
                have = 0
            if expected_size is not None and have == expected_size and have > 0:
                emit(progress, "downloaded", part, have, expected_size)
                return have
            headers = {"Range": f"bytes={have}-"} if have else {}
            try:
                response = transport.open(url, headers)
            except NETWORK_ERRORS as e:
                self._check_cancel()  # a cancel shuts the socket: that is not a network failure
                fail(f"cannot reach {host_of(url)} ({describe_network_error(e)})")
                continue

            try:
                status = _status(response)
                if status in FINAL_STATUSES:
                    raise status_error(url, status)
                if status == 416 and have:
                    # Our partial is as long as (or longer than) the file: the Content-Range says which.
                    total_match = re.search(r"/(\d+)", response.headers.get("Content-Range", "") or "")
                    if total_match and int(total_match.group(1)) == have:
                        return have
                    _truncate(partial)
                    fail("server rejected the resume range")
                    continue
                if status == 429 or status >= 500:
                    fail(f"HTTP {status} from {host_of(url)}", response.headers.get("Retry-After"), status)
                    continue
                if status not in (200, 206):
                    raise status_error(url, status)

                length = response.headers.get("Content-Length")
                if status == 206:
                    content_range = parse_content_range(response.headers.get("Content-Range"))
                    if content_range is None or content_range[0] != have:
                        # A range we did not ask for: appending it would misplace bytes.
                        _truncate(partial)
                        fail("server answered a different range than requested")
                        continue
                    total = content_range[1]
                    self.resumable = True
                else:
                    self.resumable = (response.headers.get("Accept-Ranges") or "").strip().lower() == "bytes"
                    if have:
                        emit(progress, "server ignored the resume request; restarting", part, 0, expected_size)
                        _truncate(partial)
                        have = 0
                    total = int(length) if length and length.isdigit() else None
                if expected_size is not None and total is not None and total != expected_size:
                    raise DownloadError(
                        f"{part}: the server reports {total} bytes but {expected_size} were expected"
                    )
                total = total if total is not None else expected_size
                if total is not None:
                    ensure_free_space(partial.parent, total - have, part, self.limits.min_free)

                have = self.copy_body(response, have, total)
                if total is not None and have < total:
                    self._progressed(have)
                    fail(f"connection closed after {have} of {total} bytes")
                    continue
                if total is not None and have > total:
                    _truncate(partial)
                    fail("server sent more bytes than announced")
                    continue
                return have
            except _Dropped as e:
                fail(f"connection dropped ({e})")
                continue
            finally:
                response.close()

    def copy_body(self, response: Response, have: int, total: int | None) -> int:
        """Append the body to the partial; returns the bytes now in it."""
        read = getattr(response, "read1", response.read)  # read1: return what arrived, do not wait for CHUNK
        checked_at, shown_at = have - DISK_CHECK_EVERY, have  # the first chunk checks the disk
        with open(self.partial, "r+b" if have else "wb") as f:
            f.seek(have)
            while True:
                try:
                    chunk = read(CHUNK)
                except NETWORK_ERRORS as e:
                    self._check_cancel()
                    self._progressed(have)
                    if isinstance(e, (TimeoutError, socket.timeout)):
                        raise self.stalled() from None
                    raise _Dropped(describe_network_error(e)) from None
                self._check_cancel()  # a cancel shuts the socket, which reads as the end of the body
                if not chunk:
                    break
                write_chunk(f, chunk, self.part, resumable=True)
                have += len(chunk)
                if have - checked_at >= DISK_CHECK_EVERY:
                    checked_at = have
                    _check_running_space(self.partial.parent, self.part, self.limits.min_free)
                if have - shown_at >= CHUNK or have == total:
                    shown_at = have
                    emit(self.progress, "downloading", self.part, have, total)
        if have != shown_at:
            emit(self.progress, "downloading", self.part, have, total)
        return have

    def stalled(self) -> NetworkError:
        after = f" for {self.limits.stall_timeout:g} s" if self.limits.stall_timeout else ""
        keep = "; pull again to resume" if self.resumable else ""
        return NetworkError(f"download of {self.part} from {host_of(self.url)} stalled: no data arrived{after}{keep}")


class _Dropped(Exception):
    """The body stopped mid-transfer (reset, timeout, short read)."""


class _Attempts:
    """Consecutive failures of one transfer; progress resets the count, so only a dead link gives up."""

    def __init__(self, retry: RetryPolicy, url: str, what: str, progress: Progress = None, part: str | None = None,
                 cancel: CancelToken | None = None):
        self.retry, self.url, self.what, self.progress, self.part = retry, url, what, progress, part
        self.cancel = cancel
        self.failures = 0

    def fail(self, message: str, retry_after: str | None = None, status: int | None = None) -> None:
        """Count a failure and wait, or raise once `attempts` failures came in a row: the HTTP
        status error when the server kept answering `status`, else a NetworkError."""
        self.failures += 1
        if self.failures >= self.retry.attempts:
            if status is not None:
                raise status_error(self.url, status, self.failures)
            raise NetworkError(f"{self.what} failed after {self.failures} tries: {message}")
        emit(self.progress, f"retrying ({message})", self.part)
        self.retry.wait(self.failures, retry_after, self.cancel)

    def progressed(self) -> None:
        self.failures = 0


def _status(response: Response) -> int:
    return int(getattr(response, "status", None) or getattr(response, "code", 0))


MAX_JSON_BYTES = 16 * 1024 * 1024


def fetch_json(url: str, transport: Transport | None = None, retry: RetryPolicy | None = None) -> Any:
    """GET a small JSON document (the Hub's file listing), with the same retry and error rules."""
    transport = transport or UrllibTransport()
    attempts = _Attempts(retry or RetryPolicy(), url, f"request to {host_of(url)}")
    while True:
        try:
            response = transport.open(url, {"Accept": "application/json"})
        except NETWORK_ERRORS as e:
            attempts.fail(f"cannot reach {host_of(url)} ({describe_network_error(e)})")
            continue
        try:
            status = _status(response)
            if status == 429 or status >= 500:
                attempts.fail(f"HTTP {status}", response.headers.get("Retry-After"), status)
                continue
            if status != 200:
                raise status_error(url, status)
            try:
                body = response.read(MAX_JSON_BYTES + 1)  # a listing is small; bound what we parse
            except NETWORK_ERRORS as e:
                attempts.fail(f"connection dropped ({describe_network_error(e)})")
                continue
            if len(body) > MAX_JSON_BYTES:
                raise DownloadError(f"response from {host_of(url)} is too large")
            try:
                return json.loads(body)
            except ValueError:
                raise DownloadError(f"{host_of(url)} did not answer with JSON") from None
        finally:
            response.close()
