"""What the manager remembers of its engine workers' deaths: restarts, backoff, and failed models.

A worker that dies (engine/worker/proxy.py) has already ended its own requests; the manager forgets
the loaded model, and the next request for it loads it again. A model that keeps dying must not
keep the machine busy reloading it: each load after a recent crash waits a little longer (1 s, then
4 s), and the third crash within CRASH_WINDOW_S marks it failed: requests for it get
ModelFailedError (503, with the crash's reason) and `ps`, /api/ps and the dashboard show why, until
the user loads it again explicitly (Ollama's empty-prompt `/api/generate`, as `ollama run` sends).

A hang watchdog kill of an engine's first step restarts the model with the same backoff but does
not count toward marking it failed: the watchdog's limit then knows none of the engine's steps, and
a first prefill that is only slow (a long prompt on a slow machine, where the step's progress is
not counted natively) is as likely as a hang. Its reason says so (engine/worker/proxy.py HangReason:
`first_step`); a model whose first step truly hangs is retried once per watchdog limit, 30 s or
more apart.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import ModelFailedError

CRASH_WINDOW_S = 300.0  # crashes this close together count as "in a row"
FAIL_AFTER = 3
BACKOFF_S = (1.0, 4.0)  # before the load after the 1st, 2nd crash in the window


@dataclass
class CrashBook:
    recent: dict[str, list[tuple[float, str]]] = field(default_factory=dict)  # model -> (monotonic, reason)
    failed: dict[str, str] = field(default_factory=dict)  # model -> why, shown to the user
    restarts: Counter = field(default_factory=Counter)  # every crash since the daemon started

    def record(self, model: str, reason: str) -> None:
        now = time.monotonic()
        crashes = [c for c in self.recent.get(model, []) if now - c[0] < CRASH_WINDOW_S] + [(now, reason)]
        self.recent[model] = crashes
        self.restarts[model] += 1
        counted = [c for c in crashes if counts(c[1])]
        if counts(reason) and len(counted) >= FAIL_AFTER:
            minutes = (now - counted[0][0]) / 60
            self.failed[model] = (f"its engine stopped {len(counted)} times in {max(minutes, 0.1):.1f} min "
                                  f"(last: {reason}); load it again to retry")

    def check(self, model: str) -> None:
        if model in self.failed:
            raise self.error(model)

    def error(self, model: str) -> ModelFailedError:
        return ModelFailedError(f"model {model} is not loaded: {self.failed.get(model, 'it failed')}",
                                retry_after=60.0)

    def backoff(self, model: str) -> float:
        """Seconds a load of `model` should still wait after its recent crashes."""
        now = time.monotonic()
        crashes = [c for c in self.recent.get(model, []) if now - c[0] < CRASH_WINDOW_S]
        if not crashes:
            return 0.0
        wait = BACKOFF_S[min(len(crashes), len(BACKOFF_S)) - 1]
        return max(0.0, crashes[-1][0] + wait - now)

    def forgive(self, model: str) -> None:
        """The user asked for this model explicitly: try it afresh."""
        self.failed.pop(model, None)
        self.recent.pop(model, None)


def counts(reason: str) -> bool:
    """Whether a crash with this reason counts toward marking its model failed (see the docstring)."""
    return not getattr(reason, "first_step", False)
