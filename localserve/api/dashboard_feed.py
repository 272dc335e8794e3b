"""The dashboard's snapshot: one dict a second for every open page and the tray, computed once.

Each snapshot holds, per loaded model, the engine's stats (ModelManager.status()), the exact recent
latencies (live.LatencyRings), one row per request in flight (never its content: lane, dialect,
route, prompt progress, tokens, age, state), what the steps since the previous snapshot were made
of, and how the KV cells split; and for the server, requests per dialect and route, tokens per
lane, and the one-line state the tray's menu shows too.

However many pages are open, a snapshot is computed at most once per interval and shared: the
cost is one sort of each latency ring and one copy of each engine's request table a second. The
step times come from the engine's last ten seconds of steps (engine/live.py), read at each
snapshot, so they are recorded while a dashboard or the tray is watching.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..engine import live as engine_live
from ..protocol.requests import LANES
from .metrics import Metrics

if TYPE_CHECKING:
    from ..runtime.manager import ModelManager

BUSY = ("prefilling", "decoding")
NO_STEPS = {"seconds": 0.0, "steps": 0, "decode_rows": 0, "prompt_rows": 0, "interrupted": 0}


class DashboardFeed:
    def __init__(self, manager: "ModelManager", metrics: Metrics, interval_s: float = 1.0):
        self.manager = manager
        self.metrics = metrics
        self.interval_s = interval_s
        self._cached: dict[str, Any] | None = None
        self._cached_at = 0.0
        self._last_step: dict[str, float] = {}  # model -> the end of the last step already counted
        self._last_interrupted: dict[str, int] = {}
        self._last_tick: dict[str, float] = {}
        self._mix: dict[str, dict[str, Any]] = {}  # model -> the last shared snapshot's step mix
        self._pending: dict[str, list[int]] = {}  # model -> [steps, decode rows, prompt rows] since it

    def snapshot(self, pulls: int = 0, api_key: bool = False, interval_s: float | None = None,
                 fresh: bool = False) -> dict[str, Any]:
        """The shared snapshot, recomputed when the last one is an interval old. `fresh`: one made
        now for a single read (the tray, right after it unloaded a model, must see it gone); it
        shows the last shared snapshot's step mix, whose steps stay counted for the next one."""
        interval = self.interval_s if interval_s is None else interval_s
        now = time.monotonic()
        if fresh:
            snap = self._compute(now, advance=False)
        else:
            if self._cached is None or now - self._cached_at >= interval * 0.95:
                self._cached = self._compute(now, advance=True)
                self._cached_at = now
            snap = self._cached
        return {**snap, "pulls": pulls, "api_key": api_key, "summary": summary_line(snap["models"], pulls)}

    def _compute(self, now: float, advance: bool) -> dict[str, Any]:
        engines = self.manager.engines()
        live = self.metrics.live
        models = []
        for row in self.manager.status():
            name = row["name"]
            stats = row.get("stats") or {}
            waiting = stats.get("waiting") or row.get("waiting") or {}
            model: dict[str, Any] = {
                "name": name, "state": row.get("state", "loaded"),
                "memory_bytes": row.get("memory_bytes", 0), "device": row.get("device"),
                # Held now (None: not measurable apart from the daemon) and the most it may grow to.
                "memory_held_bytes": row.get("memory_held_bytes"),
                "memory_max_bytes": row.get("memory_max_bytes", row.get("memory_bytes", 0)),
                "expires_in": row.get("expires_in"), "pinned": row.get("pinned", 0),
                # Requests waiting for it to load (or to admit them again) and why: which model must drain.
                "waiting_for_load": row.get("waiting_for_load", 0), "reason": row.get("reason", ""),
                "running": stats.get("running", 0), "waiting": {lane: waiting.get(lane, 0) for lane in LANES},
                "max_sequences": stats.get("max_sequences", 0),
                "kv_used": stats.get("kv_used", 0), "kv_total": stats.get("kv_total", 0),
                "tokens_per_s": stats.get("tokens_per_s", 0.0),
                "prompt_tokens_per_s": stats.get("prompt_tokens_per_s", 0.0),
                "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),
                "steps": stats.get("steps", 0), "busy": stats.get("busy", False),
                # Its engine's own process (engine/worker/): pid and uptime; crashes since the daemon started.
                "worker": row.get("worker"), "restarts": row.get("restarts", 0),
                "speculation": speculation_view(stats),
            }
            engine = engines.get(name)
            if engine is not None:
                model.update(self._engine_view(name, engine, stats, now, advance))
            model["latency"] = self.metrics.rings.summary(name, now)
            models.append(model)
        return {"time": time.time(), "models": models, "traffic": live.traffic_rows(),
                "lane_tokens": {lane: live.lane_tokens.get(lane, 0) for lane in LANES}}

    def _engine_view(self, name: str, engine: Any, stats: dict[str, Any], now: float, advance: bool) -> dict[str, Any]:
        progress = engine_live.sequences(engine)
        rows = []
        for request_id, tracked in self.metrics.live.of_model(name).items():
            p = progress.get(request_id)
            if p is None:
                continue  # finished: its handler is writing the last bytes
            rows.append({"id": request_id, "lane": tracked.origin.lane, "dialect": tracked.origin.dialect,
                         "route": tracked.origin.route, **p.to_dict()})
        rows.sort(key=lambda r: -r["age_s"])
        self._take_steps(name, engine)
        composition = self._step_mix(name, stats, now) if advance else self._mix.get(name, NO_STEPS)
        used, total = int(stats.get("kv_used", 0)), int(stats.get("kv_total", 0))
        parked = min(used, engine_live.parked_cells(engine))
        return {
            "sequences": rows, "step_mix": composition,
            "kv": {"total": total, "running": used - parked, "parked": parked, "free": max(0, total - used)},
            "running_by_lane": {lane: sum(1 for r in rows if r["lane"] == lane and r["state"] in BUSY) for lane in LANES},
        }


    def _take_steps(self, name: str, engine: Any) -> None:
        """The steps ended since the last read: their times go to the step ring, their rows to the
        next shared snapshot's step mix."""
        steps = engine_live.steps_since(engine, self._last_step.get(name, 0.0))
        if not steps:
            return
        self._last_step[name] = steps[-1][0]
        for end, seconds, _, _ in steps:
            self.metrics.rings.add(name, "step", "", seconds, end)
        pending = self._pending.setdefault(name, [0, 0, 0])
        pending[0] += len(steps)
        pending[1] += sum(s[2] for s in steps)
        pending[2] += sum(s[3] for s in steps)

    def _step_mix(self, name: str, stats: dict[str, Any], now: float) -> dict[str, Any]:
        """What the steps since the previous shared snapshot were made of."""
        n_steps, decode_rows, prompt_rows = self._pending.pop(name, [0, 0, 0])
        interrupted = int(stats.get("interrupted_steps", 0))
        since = self._last_tick.get(name)
        self._last_tick[name] = now
        mix = {"seconds": round(now - since, 3) if since is not None else 0.0, "steps": n_steps,
               "decode_rows": decode_rows, "prompt_rows": prompt_rows,
               "interrupted": interrupted - self._last_interrupted.get(name, interrupted)}
        self._last_interrupted[name] = interrupted
        self._mix[name] = mix
        return mix


def speculation_view(stats: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding's figures (batching/speculation.py): the mode, draft tokens verified and
    accepted per lane, the acceptance rate and the tokens each verification emitted on average."""
    drafted = stats.get("draft_tokens") or {}
    accepted = stats.get("draft_accepted") or {}
    verifications = int(stats.get("draft_verifications", 0))
    total_drafted, total_accepted = sum(drafted.values()), sum(accepted.values())
    return {"mode": stats.get("speculative", "off"),
            "lanes": {lane: {"drafted": drafted.get(lane, 0), "accepted": accepted.get(lane, 0)} for lane in LANES},
            "acceptance": round(total_accepted / total_drafted, 4) if total_drafted else 0.0,
            "tokens_per_verification": round(1 + total_accepted / verifications, 2) if verifications else 0.0}


def summary_line(models: list[dict[str, Any]], pulls: int = 0) -> str:
    """The daemon in one line, as the dashboard's header and the tray's menu show it."""
    loaded = [m for m in models if m.get("state") == "loaded"]
    running = {lane: sum(m.get("running_by_lane", {}).get(lane, 0) for m in loaded) for lane in LANES}
    line = f"{len(loaded)} model{'' if len(loaded) == 1 else 's'} loaded"
    line += " · running: " + ", ".join(f"{lane} {running[lane]}" for lane in LANES)
    if pulls:
        line += f" · {pulls} pull{'' if pulls == 1 else 's'}"
    return line

