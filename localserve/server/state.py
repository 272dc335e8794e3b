"""Typed keys of the application state (aiohttp's AppKey: no string keys that collide or typo)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..config.settings import Settings

if TYPE_CHECKING:
    from ..runtime.manager import ModelManager
    from ..store.cache import ModelStore
    from ..api.metrics import Metrics
    from ..api.dashboard_feed import DashboardFeed
    from .slots import SlotClaims

SETTINGS_KEY = web.AppKey("settings", Settings)
MANAGER_KEY: "web.AppKey[ModelManager]" = web.AppKey("manager", Any)  # type: ignore[arg-type]
STORE_KEY: "web.AppKey[ModelStore]" = web.AppKey("store", Any)  # type: ignore[arg-type]
METRICS_KEY: "web.AppKey[Metrics]" = web.AppKey("metrics", Any)  # type: ignore[arg-type]
STARTED_KEY = web.AppKey("started", float)
FEED_KEY: "web.AppKey[DashboardFeed]" = web.AppKey("dashboard_feed", Any)  # type: ignore[arg-type]
SLOTS_KEY: "web.AppKey[SlotClaims]" = web.AppKey("id_slots", Any)  # type: ignore[arg-type]
