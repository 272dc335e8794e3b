"""Conversion on first use: placement chose the onnx backend for a tag that holds only a GGUF.

The load converts the GGUF into the tag's `onnx` variant (weights for the execution provider it
will run on), logging its progress, and loads that. `localserve run` does the same beforehand in
the terminal with a progress bar (commands/convert.py), so a chat never sits silent for the
minutes a large model takes. Two processes may race to convert the same tag (the CLI and the
daemon, or two daemons' loads): the store's atomic rename lets one win, and the loser takes the
winner's variant instead of failing.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..config.settings import Settings
from ..store.cache import InstalledModel, ModelStore

log = logging.getLogger(__name__)


def convert_for_load(installed: InstalledModel, settings: Settings, execution_provider: str | None,
                     progress: Callable[[int, int], None] | None = None) -> InstalledModel:
    """`installed` with an onnx variant, converted now unless another process just did."""
    from .install import convert_installed

    store = ModelStore(settings)
    current = store.find(installed.ref)
    if "onnx" in current.variants:  # converted since the plan was made (`run` converts before loading)
        return current
    log.info("converting %s to ONNX for %s on first use", installed.ref, execution_provider or "CPUExecutionProvider")
    try:
        converted = convert_installed(store, installed, progress or _log_progress(installed.ref),
                                      execution_provider=execution_provider)
    except Exception:
        current = store.find(installed.ref)
        if "onnx" in current.variants:  # converted by someone else meanwhile
            return current
        raise
    log.info("converted %s: onnx variant stored", installed.ref)
    return converted


def _log_progress(ref: str) -> Callable[[int, int], None]:
    """Log every tenth of the tensors: a daemon has no terminal to draw a bar in."""
    last = [-1]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            log.info("converting %s: %d/%d tensors", ref, done, total)

    return report
