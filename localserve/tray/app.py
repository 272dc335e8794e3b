"""The tray process: pystray's icon, refreshed from the daemon every POLL_S, its menu rebuilt from
menu.build_menu at each opening. Menu actions run on their own threads, so a model load never
freezes the menu; their failures become notifications."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from typing import Any, Callable

from ..desktop import autostart
from ..config.settings import Settings
from ..desktop.daemon import ensure_daemon
from ..errors import ConfigError, LocalserveError
from .actions import TrayActions
from .icon import icon_image
from .menu import SEPARATOR, Item, build_menu, tooltip
from .state import DaemonState, read_state
from .xorg import dispatch_on_own_connection, is_xorg, wake_x_loop

log = logging.getLogger(__name__)
POLL_S = 2.0


def _pystray() -> Any:
    try:
        import pystray
    except ImportError:
        raise ConfigError("the tray needs its extra: pip install 'localserve[tray]'") from None
    except Exception as e:  # pystray connects to the display on import (Xlib's DisplayNameError…)
        raise ConfigError(f"the tray needs a desktop session: {e}") from None
    return pystray


class TrayApp:
    def __init__(self, settings: Settings, start_daemon: bool = True, **action_options: Any):
        self.settings = settings
        self.start_daemon = start_daemon
        self.pystray = _pystray()
        self.state = DaemonState("stopped", settings.base_url)
        self.stopped = threading.Event()
        # pystray runs icon changes on its X loop and waits for the answer: one that starts after
        # stop() waits forever (and stop() joins the poller that is waiting). Changes and quit take
        # this lock in turn, and no change starts once stopped is set.
        self.icon_lock = threading.Lock()
        self.actions = TrayActions(settings, self.quit, **action_options)
        self.icon = self.pystray.Icon("localserve", icon_image("stopped"), tooltip(self.state),
                                      menu=self.pystray.Menu(lambda: self._items(build_menu(self.state))))
        if is_xorg(self.icon):
            dispatch_on_own_connection(self.icon)

    # --- pystray wiring ------------------------------------------------------------------------
    def _items(self, items: tuple[Item, ...]) -> list[Any]:
        return [self._item(item) for item in items]

    def _item(self, item: Item) -> Any:
        p = self.pystray
        if item == SEPARATOR:
            return p.Menu.SEPARATOR
        if item.children:
            return p.MenuItem(item.text, p.Menu(*self._items(item.children)), enabled=item.enabled)
        return p.MenuItem(
            item.text, self._on_click(item) if item.action else None,
            checked=(lambda _item, it=item: bool(it.checked)) if item.checked is not None else None,
            enabled=item.enabled and item.action is not None, default=item.default)

    def _on_click(self, item: Item) -> Callable[[Any, Any], threading.Thread]:
        # A closure, not a lambda with a default argument: pystray counts an action's parameters
        # (defaults included) and refuses anything but 0, 1 or 2.
        def clicked(_icon: Any, _menu_item: Any) -> threading.Thread:
            return self.invoke(item)

        return clicked

    def invoke(self, item: Item) -> threading.Thread:
        """Run an item's action on its own thread, then refresh the icon."""
        def work() -> None:
            try:
                self.actions.run(item.action or "", item.arg, self.state)
            except LocalserveError as e:
                self.notify(f"{item.text}: {e}")
            except Exception:  # a tray must survive a failing action
                log.exception("tray action %s failed", item.action)
                self.notify(f"{item.text} failed; see the logs")
            self.refresh()

        thread = threading.Thread(target=work, name=f"tray-{item.action}", daemon=True)
        thread.start()
        return thread

    # --- state ---------------------------------------------------------------------------------
    def refresh(self) -> DaemonState:
        old = self.state
        new = read_state(self.actions.client(), self.settings.base_url, autostart.status().enabled,
                         self.settings.log_dir)
        self.state = new
        if new.status == "stopped" and new.error and old.status != "stopped":
            self.notify(new.error)  # the daemon died from a signal: say how, once
        if old.pulls > new.pulls:
            pulled = set(new.installed) - set(old.installed)
            self.notify(f"Pulled {', '.join(sorted(pulled))}" if pulled else "A pull ended without a new model")
        if new != old:
            with self.icon_lock:
                if not self.stopped.is_set():
                    self.icon.icon = icon_image(new.status)
                    self.icon.title = tooltip(new)
                    self.icon.update_menu()
        return new

    def notify(self, message: str) -> None:
        if getattr(self.icon, "HAS_NOTIFICATION", False):
            self.icon.notify(message, "localserve")
        elif shutil.which("notify-send"):  # pystray's X backend has none; the desktop's own tool
            subprocess.Popen(["notify-send", "localserve", message], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        else:
            log.info("notification: %s", message)

    def _poll(self, icon: Any) -> None:
        icon.visible = True
        if self.start_daemon:
            try:
                ensure_daemon(self.settings)
            except LocalserveError as e:
                self.notify(f"could not start the server: {e}")
        while not self.stopped.is_set():
            try:
                self.refresh()
            except Exception:
                log.exception("tray refresh failed")
            self.stopped.wait(POLL_S)

    def run(self) -> None:
        self.icon.run(setup=self._poll)

    def quit(self) -> None:
        with self.icon_lock:
            self.stopped.set()
        self.icon.stop()
        if is_xorg(self.icon):
            wake_x_loop(self.icon._window.id)


def run_tray(settings: Settings) -> int:
    TrayApp(settings).run()
    return 0
