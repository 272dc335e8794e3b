"""pystray's X backend, made safe to drive from threads other than its loop's.

pystray runs every icon change (show, hide, icon, title, stop) on its loop thread: the calling
thread sends a ClientMessage to the icon's window and waits for the loop to run the change. It
sends and flushes that message on the loop's own X connection, and python-xlib 0.33 loses wake-ups
between two threads in send_and_recv: a sender that finds a reply readable but is not the
receiving thread returns without waking the thread that waits for that reply. The loop then waits
forever in the middle of a redraw (get_geometry), and the caller waits forever for the loop. Seen
as a hang of tests/system/test_tray_xvfb.py in a CI run; a title set 3,000 times from a second thread
under a flood of Expose events froze in 3 of 3 runs, after 13 to 124 changes. Flushing the loop's
connection from a watchdog thread did not cure it (it froze later, with other stale states).

So the message goes out on a connection of our own, which only callers use, one at a time: the
loop's connection is then touched by the loop thread alone, and the loop receives the message as
the event it already handles.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

# pystray's X backend runs these on its loop thread ("_PYSTRAY_" + the name upper-cased is the
# ClientMessage type it listens for).
LOOP_METHODS = ("_show", "_hide", "_update_icon", "_update_title", "_stop")


def is_xorg(icon: Any) -> bool:
    return type(icon).__module__.endswith("_xorg")


def dispatch_on_own_connection(icon: Any) -> None:
    """Replace pystray's cross-thread dispatch of `icon`'s loop methods with one that sends its
    message on a private X connection. On the loop thread a method runs directly, as before."""
    import Xlib.display
    from Xlib import X
    from Xlib.protocol import event

    try:
        display = Xlib.display.Display()
    except Exception:  # noqa: BLE001 - the icon's own connection just opened; keep pystray's dispatch
        log.warning("no second X connection for the tray icon: its changes go through pystray's own")
        return
    window = display.create_resource_object("window", icon._window.id)
    lock = threading.Lock()  # one caller at a time: the connection, and pystray's one result queue

    def dispatcher(name: str, pystrays: Any) -> Any:
        atom = display.intern_atom(f"_PYSTRAY_{name.upper()}")

        def call() -> None:
            loop = getattr(icon, "_thread", None)
            if loop is not None and threading.current_thread().ident == loop.ident:
                return pystrays()  # pystray's own dispatcher runs it in place
            with lock:
                window.send_event(event.ClientMessage(window=window, client_type=atom,
                                                      data=(32, [X.CurrentTime, 0, 0, 0, 0])),
                                  event_mask=X.NoEventMask)
                display.flush()
                result = icon._queue.get()
            if result is not True:
                raise result[1].with_traceback(result[2])

        return call

    for name in LOOP_METHODS:
        setattr(icon, name, dispatcher(name, getattr(icon, name)))


def wake_x_loop(window_id: int) -> None:
    """Deliver a no-op event to the icon's window from a second X connection.

    pystray's X backend stops by asking its own loop to destroy the icon, but that loop sits in
    python-xlib's next_event, which can hold the request until some event arrives: under Xvfb, half
    of 20 stops never ended. Any event wakes it; the window may already be gone, which is fine."""
    import Xlib.display
    from Xlib import X
    from Xlib.protocol import event

    try:
        display = Xlib.display.Display()
    except Exception:  # no display left to wake: nothing waits on it either
        return
    try:
        display.set_error_handler(lambda *_: None)  # BadWindow when the loop already ended
        window = display.create_resource_object("window", window_id)
        window.send_event(event.ClientMessage(window=window, client_type=display.intern_atom("_LOCALSERVE_WAKE"),
                                              data=(32, [0] * 5)), event_mask=X.NoEventMask)
        display.sync()
    finally:
        display.close()
