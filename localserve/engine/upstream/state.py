"""One configured upstream and what the daemon knows of it now (pool.py keeps them)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...config.upstreams import UpstreamConfig


@dataclass
class Upstream:
    """One configured upstream and what we know of it now."""

    config: UpstreamConfig
    state: str = "unknown"  # unknown (not checked yet), up, down
    outstanding: int = 0
    failures: int = 0  # consecutive
    retry_at: float = 0.0  # monotonic; when a down upstream is probed again
    remote_models: tuple[str, ...] = ()  # its /models ids, for models = ["*"]
    listed_at: float = 0.0
    served: int = 0
    errors: int = 0
    last_error: str = ""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def available(self) -> bool:
        return self.state != "down"

    def row(self) -> dict[str, Any]:
        """For /api/ps, `localserve ps` and /metrics: state, never the URL's key."""
        retry = max(0.0, self.retry_at - time.monotonic()) if self.state == "down" else 0.0
        return {"name": self.name, "url": self.config.url, "state": self.state, "outstanding": self.outstanding,
                "max_concurrency": self.config.max_concurrency, "failures": self.failures,
                "retry_in": round(retry, 1), "served": self.served, "errors": self.errors,
                "last_error": self.last_error}
