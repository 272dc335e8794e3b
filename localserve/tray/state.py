"""The daemon as the tray sees it: one snapshot, read over HTTP through DaemonClient only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..desktop.client import DaemonClient
from ..desktop.daemon import LOG_NAME
from ..desktop.daemon_crash import explain, last_death
from ..errors import LocalserveError
from ..protocol.requests import LANES

STATUSES = ("stopped", "idle", "generating", "pulling", "error")


@dataclass(frozen=True)
class DaemonState:
    status: str  # one of STATUSES
    url: str
    installed: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()
    queued: dict[str, int] = field(default_factory=lambda: {lane: 0 for lane in LANES})
    tokens_per_s: float = 0.0
    api_key_set: bool = False
    autostart: bool = False
    pulls: int = 0
    error: str | None = None
    # The daemon's own one-line state (models loaded, requests running per lane), as the dashboard's header shows it.
    summary: str = ""
    # Per loaded model: (bytes held now, None where unmeasured; the most it may grow to). Absent
    # for a model whose row lacks the figures (an older daemon).
    memory: dict[str, tuple[int | None, int]] = field(default_factory=dict)


def from_snapshot(url: str, snapshot: dict[str, Any], tags: dict[str, Any], autostart: bool) -> DaemonState:
    """The state from /api/dashboard/state and /api/tags answers (recorded ones in tests)."""
    models = [m for m in snapshot.get("models", []) if m.get("state") == "loaded"]
    queued = {lane: sum(int(m.get("waiting", {}).get(lane, 0)) for m in models) for lane in LANES}
    busy = any(m.get("running") or m.get("busy") for m in models) or any(queued.values())
    pulls = int(snapshot.get("pulls", 0))
    status = "generating" if busy else "pulling" if pulls else "idle"
    return DaemonState(
        status=status, url=url,
        installed=tuple(sorted(m["name"] for m in tags.get("models", []))),
        loaded=tuple(m["name"] for m in models), queued=queued,
        tokens_per_s=round(sum(float(m.get("tokens_per_s", 0.0)) for m in models), 1),
        api_key_set=bool(snapshot.get("api_key")), autostart=autostart, pulls=pulls,
        summary=str(snapshot.get("summary", ""))[:120],
        memory={m["name"]: (m["memory_held_bytes"], int(m.get("memory_max_bytes") or 0))
                for m in models if "memory_held_bytes" in m},
    )


def read_state(client: DaemonClient | None, url: str, autostart: bool, log_dir: Path | None = None) -> DaemonState:
    """None for a client means no daemon runs; a daemon that answers badly is an "error" state.

    A stopped daemon whose last run ended in a fatal signal carries that line as its error (from
    the fault record in `log_dir`), until the next start."""
    if client is None:
        death = last_death(log_dir) if log_dir is not None else None
        line = explain(log_dir, log_dir / LOG_NAME, death.pid, "serving") if death and log_dir else None
        return DaemonState("stopped", url, autostart=autostart, error=line)
    try:
        return from_snapshot(url, client.request_json("GET", "/api/dashboard/state"),
                             client.request_json("GET", "/api/tags"), autostart)
    except LocalserveError as e:
        return DaemonState("error", url, autostart=autostart, error=str(e))
