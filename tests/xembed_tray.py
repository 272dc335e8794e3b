"""A real X server (Xvfb) and the smallest real system tray for it, for tests of tray icons.

Xvfb has no desktop, so nothing owns the `_NET_SYSTEM_TRAY_S<n>` selection and pystray's X backend
has nowhere to dock. `TrayHost` is the manager side of the freedesktop System Tray protocol (the
part every panel implements): it owns the selection, announces itself with a MANAGER message, and
on SYSTEM_TRAY_REQUEST_DOCK reparents the icon's window into its own panel window and maps it
(XEmbed's embedding; the icon then draws itself on the Expose/ConfigureNotify it gets).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import threading
from typing import Any

PANEL = (0, 0, 160, 40)  # x, y, width, height of the tray's panel on the screen
ICON_SIZE = 32
SYSTEM_TRAY_REQUEST_DOCK = 0

XVFB = shutil.which("Xvfb")


class Xvfb:
    """A private X display; `display` is its name (":N"), chosen by Xvfb itself (-displayfd)."""

    def __init__(self, size: str = "480x200x24"):
        self.size = size
        self.display = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "Xvfb":
        assert XVFB
        read, write = os.pipe()
        self.proc = subprocess.Popen([XVFB, "-displayfd", str(write), "-screen", "0", self.size, "-nolisten", "tcp"],
                                     pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(write)
        with os.fdopen(read) as f:
            number = f.readline().strip()  # written once the server accepts connections
        assert number, "Xvfb did not start"
        self.display = f":{number}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)


class TrayHost:
    """The system-tray manager, on its own connection and thread. `docked` holds the window ids of
    the icons it embedded."""

    def __init__(self, display_name: str):
        import Xlib.display
        from Xlib import X

        self.d = Xlib.display.Display(display_name)
        screen = self.d.screen()
        x, y, w, h = PANEL
        self.panel = screen.root.create_window(x, y, w, h, 0, screen.root_depth, background_pixel=0xE6E8EB,
                                               event_mask=X.StructureNotifyMask | X.SubstructureNotifyMask)
        self.panel.map()
        self.selection = self.d.intern_atom(f"_NET_SYSTEM_TRAY_S{self.d.get_default_screen()}")
        self.opcode = self.d.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
        self.docked: list[int] = []
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tray-host", daemon=True)

    def __enter__(self) -> "TrayHost":
        from Xlib import X
        from Xlib.protocol import event

        self.panel.set_selection_owner(self.selection, X.CurrentTime)
        root = self.d.screen().root
        # Clients that started before the tray wait for this broadcast (the spec's MANAGER message).
        root.send_event(event.ClientMessage(window=root, client_type=self.d.intern_atom("MANAGER"),
                                            data=(32, [X.CurrentTime, self.selection, self.panel.id, 0, 0])),
                        event_mask=X.StructureNotifyMask)
        self.d.sync()
        assert self.d.get_selection_owner(self.selection) == self.panel
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.d.close()

    def _loop(self) -> None:
        from Xlib import X

        while not self.stopping.is_set():
            if not self.d.pending_events():
                select.select([self.d.fileno()], [], [], 0.05)
                continue
            e = self.d.next_event()
            if e.type == X.ClientMessage and e.client_type == self.opcode and e.data[1][1] == SYSTEM_TRAY_REQUEST_DOCK:
                self._dock(e.data[1][2])

    def _dock(self, window_id: int) -> None:
        icon: Any = self.d.create_resource_object("window", window_id)
        # A client may ask again (pystray does on every icon update): same slot, mapped again.
        slot = self.docked.index(window_id) if window_id in self.docked else len(self.docked)
        icon.reparent(self.panel, 4 + slot * (ICON_SIZE + 4), (PANEL[3] - ICON_SIZE) // 2)
        icon.configure(width=ICON_SIZE, height=ICON_SIZE)
        icon.map()
        self.d.sync()
        with self.changed:
            if window_id not in self.docked:
                self.docked.append(window_id)
            self.changed.notify_all()

    def wait_docked(self, window_id: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: window_id in self.docked, timeout)
