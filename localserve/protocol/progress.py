"""Progress events of a pull: small values a rich progress bar or an NDJSON stream can both render."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class PullEvent:
    status: str  # human text: "resolving hf.co/...", "downloading", "verifying sha256", "success", ...
    part: str | None = None  # which file / part the byte counts belong to (one progress row each)
    completed: int | None = None  # bytes of `part` on disk so far (resumed bytes included)
    total: int | None = None  # bytes of `part` when known

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


Progress = Optional[Callable[[PullEvent], None]]


def emit(progress: Progress, status: str, part: str | None = None, completed: int | None = None,
         total: int | None = None) -> None:
    if progress is not None:
        progress(PullEvent(status, part, completed, total))
