"""A process's resident memory, read on demand: the worker's before its load (child.py) and now
(proxy.py, for ps and /api/ps). One read of /proc/PID/statm, tens of microseconds; nothing samples
an idle daemon."""

from __future__ import annotations

import psutil


def rss_bytes(pid: int | None = None) -> int | None:
    """RSS of `pid` (this process when None), or None once that process is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None
