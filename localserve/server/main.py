"""The daemon process itself (`localserve serve`): its lock, its log and fault record, the app on
its socket until SIGINT/SIGTERM, then a graceful shutdown. Finding, starting and stopping a daemon
from outside is desktop/daemon.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from ..config.private import make_private
from ..config.settings import Settings
from ..desktop.daemon import LOG_NAME, DaemonInfo, DaemonLock
from ..desktop.daemon_crash import enable_fault_record, explain, last_death
from ..errors import DaemonError


def _setup_logging(settings: Settings, background: bool) -> None:
    """Log to the log directory always; to stderr too unless detached (its stderr is a file
    that only has to catch what happens before logging is set up)."""
    import logging
    import logging.handlers

    settings.log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    level = getattr(logging, settings.log_level.upper(), logging.INFO)
    if root.level > logging.DEBUG:  # -v keeps debug
        root.setLevel(level)
    if background:
        for handler in list(root.handlers):
            root.removeHandler(handler)
    else:
        for handler in root.handlers:
            handler.setLevel(root.level)
    file_handler = logging.handlers.RotatingFileHandler(
        settings.log_dir / LOG_NAME, maxBytes=5 * 1024 * 1024, backupCount=3, encoding="utf-8"
    )
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)


def run_daemon(settings: Settings, *, background: bool = False) -> int:
    """`localserve serve`: serve in the foreground until SIGINT/SIGTERM, then shut down gracefully."""
    import asyncio

    # create_app refuses a non-loopback bind without an API key before anything listens.
    # Before the lock, the log or any store is opened: every file from here on is user-only.
    tightened = make_private(settings)
    lock = DaemonLock(settings)
    lock.acquire()
    try:
        _setup_logging(settings, background)
        if tightened:
            import logging

            logging.getLogger("localserve.daemon").info(
                "made %d files and folders that hold prompts, answers or logs user-only (0600/0700)", len(tightened))
        _report_previous_death(settings, announce=not background)
        enable_fault_record(settings.log_dir)
        asyncio.run(_serve(settings, lock, announce=not background))
    finally:
        lock.release()
    return 0


def _report_previous_death(settings: Settings, *, announce: bool) -> None:
    """Once, at the next start: the last daemon of this home died from a signal."""
    import logging

    death = last_death(settings.log_dir)
    if death is None:
        return
    line = explain(settings.log_dir, settings.log_dir / LOG_NAME, death.pid, "serving")
    logging.getLogger("localserve.daemon").warning("the previous %s", line.removeprefix("the "))
    if announce:
        print(f"Note: the previous {line.removeprefix('the ')}", file=sys.stderr, flush=True)


async def _serve(settings: Settings, lock: DaemonLock, *, announce: bool) -> None:
    import asyncio
    import logging

    from aiohttp import web

    from ..runtime.manager import ModelManager
    from ..runtime.warm_start import prepare_first_load
    from .app import create_app

    log = logging.getLogger("localserve.daemon")
    manager = ModelManager(settings)
    prepare_first_load(settings)
    app = create_app(settings, manager)
    # shutdown_timeout: how long in-flight requests may finish after the listening socket closes;
    # the rest are cancelled (their handlers close their engine streams). keepalive_timeout is
    # aiohttp's only clock on a connection before its request headers are complete (its default
    # is an hour), so idle_timeout also bounds clients that trickle headers to hold connections.
    runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_timeout, keepalive_timeout=settings.idle_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        try:
            await site.start()
        except OSError as e:
            raise DaemonError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
        port = int(runner.addresses[0][1])
        host = settings.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        url = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
        lock.publish(DaemonInfo(pid=os.getpid(), url=url, host=host, port=port, started_at=time.time()))
        log.info("localserve %s listening on %s (pid %d)", _version(), url, os.getpid())
        if announce:
            print(f"localserve listening on {url} (Ctrl-C to stop)", flush=True)

        stop = asyncio.Event()
        _install_signal_handlers(asyncio.get_running_loop(), stop)
        await stop.wait()
        log.info("shutting down: waiting up to %.0fs for in-flight requests", settings.shutdown_timeout)
    finally:
        await runner.cleanup()
        await manager.close()
        log.info("stopped")


def _install_signal_handlers(loop: Any, stop: Any) -> None:
    def on_signal() -> None:
        stop.set()
        # A second Ctrl-C while shutting down kills at once, as users expect.
        if sys.platform != "win32":
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_DFL)

    if sys.platform == "win32":
        for sig in (signal.SIGINT, signal.SIGBREAK):  # type: ignore[attr-defined]
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


def _version() -> str:
    from .. import __version__

    return __version__
