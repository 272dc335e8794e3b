"""How many compute threads a backend loads with when the settings do not say."""

from __future__ import annotations

import os


def default_threads() -> int:
    """Physical cores: llama.cpp's matmuls gain nothing from SMT siblings and lose to contention."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 - psutil can fail on odd platforms/containers; fall back
        n = None
    return max(1, n or os.cpu_count() or 1)
