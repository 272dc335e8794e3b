"""What a daemon starts while it waits for its first request, so the first load waits for less.

A daemon loads a model on first use, and that first request waited for work that does not depend
on it (issue 42: cold first token 1.6 s on SmolLM2, 2 cores, against llama-server's 0.83 s start
to ready): the engine workers' fork server starting and importing (0.5-1 s), and the hardware probe
every plan reads (0.3 s: it spawns tools like nvidia-smi). Both start here, in the background; a
load that comes sooner waits only for what is left of them.
"""

from __future__ import annotations

import threading

from ..config.settings import Settings


def prepare_first_load(settings: Settings) -> None:
    if settings.engine_workers:
        from ..engine.worker.proxy import prestart_fork_server

        prestart_fork_server()  # quick: it starts the process, which imports on its own
    from .planning import hardware_report

    threading.Thread(target=hardware_report, name="hardware probe", daemon=True).start()
