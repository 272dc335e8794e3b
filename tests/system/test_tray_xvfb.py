"""The real tray (`TrayApp`, pystray's X backend) on a real X server (Xvfb) with a real system tray
(tests/xembed_tray.py), against the real daemon and model: its icon docks, shows the daemon's
state, and its menu's load, unload, copy-endpoint, copy-key and start-at-login items do what they
say, checked through the daemon's API (/api/ps), the X clipboard (xclip -o) and the XDG autostart
file. Saves docs/tray.png."""

from __future__ import annotations

import gc
import shutil
import subprocess
import threading
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterator

import pytest

from daemon_util import cli_env, free_port, register_model, serving, stop_quietly, wait_published
from xembed_tray import ICON_SIZE, PANEL, XVFB, TrayHost, Xvfb

from localserve.desktop.client import DaemonClient
from localserve.config.settings import load_settings
from localserve.tray.icon import COLOURS

pytestmark = pytest.mark.model
XCLIP = shutil.which("xclip")
if not (XVFB and XCLIP):
    pytest.skip("needs Xvfb and xclip (apt-get install xvfb xclip)", allow_module_level=True)
# Not importorskip: importing pystray connects to the display, which exists only inside the test.
if not (find_spec("pystray") and find_spec("Xlib")):
    pytest.skip("needs the tray extra and python-xlib (pip install -e '.[dev]')", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "tray.png"
MODEL = "smollm2-135m"
KEY = "tray-test-key"
LIVE_S = 60  # liveness bound only


def wait_for(condition: Any, what: str, seconds: float = LIVE_S) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.fixture
def desktop(tmp_path, monkeypatch) -> Iterator[Xvfb]:
    """A display with a system tray; this process's DISPLAY and XDG_CONFIG_HOME point at it and a
    temporary config dir (the autostart entry goes there)."""
    with Xvfb() as x, TrayHost(x.display) as host:
        monkeypatch.setenv("DISPLAY", x.display)
        monkeypatch.setenv("PYSTRAY_BACKEND", "xorg")
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
        monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)  # the clipboard is X's here
        x.host = host  # type: ignore[attr-defined]
        yield x
        # pystray's Icon closes its display connection when collected: while the server still runs.
        gc.collect()


@pytest.fixture
def daemon(tmp_path, smollm2_gguf) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    env = cli_env(home, free_port(), LOCALSERVE_API_KEY=KEY)
    register_model(env, smollm2_gguf)
    with serving(env) as proc:
        try:
            wait_published(home, proc)
            yield env
        finally:
            stop_quietly(env, proc)


def by_text(menu: Any, prefix: str) -> Any:
    return next(item for item in menu.items if item.text.startswith(prefix))


def click(app: Any, *path: str) -> None:
    """Invoke a menu item the way pystray does on a click, through the icon's own menu object, and
    wait for the action's thread (it refreshes the state when done)."""
    menu = app.icon.menu
    for text in path[:-1]:
        menu = by_text(menu, text).submenu
    thread = by_text(menu, path[-1])(app.icon)
    assert isinstance(thread, threading.Thread)
    thread.join(LIVE_S)
    assert not thread.is_alive()


def clipboard(display: str) -> str:
    return subprocess.run([XCLIP, "-selection", "clipboard", "-o", "-display", display], capture_output=True,
                          text=True, timeout=10, check=True).stdout


def icon_colour(display: str, window_id: int) -> tuple[int, int, int]:
    """What the screen shows at the icon's left edge (the state colour; the bars start further in)."""
    from PIL import ImageGrab
    from Xlib import display as xdisplay

    d = xdisplay.Display(display)
    try:
        place = d.create_resource_object("window", window_id).translate_coords(d.screen().root, 0, 0)
        x, y = -place.x, -place.y  # the window's origin on the root
    finally:
        d.close()
    return ImageGrab.grab(xdisplay=display).getpixel((x + 2, y + ICON_SIZE // 2))[:3]


def test_real_tray_docks_and_its_menu_drives_the_daemon(desktop, daemon, tmp_path):
    from Xlib import X
    from Xlib import display as xdisplay

    from localserve.tray.app import TrayApp

    settings = load_settings(environ=daemon, config_path=Path(daemon["LOCALSERVE_CONFIG"]))
    opened: list[str] = []
    app = TrayApp(settings, open_url=opened.append)
    runner = threading.Thread(target=app.run, name="tray", daemon=True)
    runner.start()
    try:
        window = app.icon._window.id  # pystray's icon window (the X backend keeps it there)
        assert desktop.host.wait_docked(window, LIVE_S), "the icon never asked the tray to dock it"
        d = xdisplay.Display(desktop.display)
        try:
            icon = d.create_resource_object("window", window)
            assert icon.query_tree().parent.id == desktop.host.panel.id
            assert icon.get_attributes().map_state == X.IsViewable
            geometry = icon.get_geometry()
            assert (geometry.width, geometry.height) == (ICON_SIZE, ICON_SIZE)
        finally:
            d.close()

        wait_for(lambda: app.state.status == "idle", "the tray to read the running daemon")
        assert app.state.api_key_set and not app.state.loaded
        wait_for(lambda: icon_colour(desktop.display, window) == COLOURS["idle"], "the icon to show idle")
        client = DaemonClient(settings.base_url, api_key=KEY)

        def loaded() -> list[str]:
            return [m["name"] for m in client.request_json("GET", "/api/ps")["models"]]

        # Models ▸ the model: loads it; the menu then checks it; the same item unloads it.
        click(app, "Models", MODEL)
        assert [n.split(":")[0] for n in loaded()] == [MODEL]
        assert by_text(by_text(app.icon.menu, "Models").submenu, MODEL).checked is True
        # The daemon's one line, the dashboard header's, in the real menu.
        summary = client.request_json("GET", "/api/dashboard/state")["summary"]
        assert summary.startswith("1 model loaded · running: interactive 0") and by_text(app.icon.menu, summary).enabled is False
        shot(desktop.display)
        click(app, "Models", MODEL)
        assert loaded() == []
        assert by_text(by_text(app.icon.menu, "Models").submenu, MODEL).checked is False

        click(app, "Copy API endpoint")
        assert clipboard(desktop.display) == settings.base_url + "/v1"
        click(app, "Copy API key")
        assert clipboard(desktop.display) == KEY

        entry = tmp_path / "xdg" / "autostart" / "localserve.desktop"  # XDG_CONFIG_HOME, set by `desktop`
        assert by_text(app.icon.menu, "Start at login").checked is False and not entry.exists()
        click(app, "Start at login")
        text = entry.read_text()
        assert "[Desktop Entry]" in text and "Exec=" in text and " tray" in text
        assert by_text(app.icon.menu, "Start at login").checked is True
        click(app, "Start at login")
        assert not entry.exists() and by_text(app.icon.menu, "Start at login").checked is False

        click(app, "Chat")
        assert opened == [settings.base_url + "/#chat"]
    finally:
        app.quit()
        runner.join(10)
    assert not runner.is_alive()


def shot(display: str) -> None:
    """The panel with the docked icon, doubled so the icon is legible in the README."""
    from PIL import Image, ImageGrab

    x, y, w, h = PANEL
    image = ImageGrab.grab(xdisplay=display).crop((x, y, x + w, y + h))
    image.resize((w * 2, h * 2), Image.NEAREST).quantize(colors=32).save(SCREENSHOT, optimize=True)


def test_icon_changes_from_another_thread_survive_a_flood_of_redraws(desktop):
    """pystray's own cross-thread dispatch froze within 13-124 title changes here (python-xlib loses
    a wake-up between the caller's flush and the loop's redraw: localserve/tray/xorg.py); with the
    message sent on a connection of our own, 3,000 changes go through. Each Expose makes the loop
    ask the server for the window's geometry, which is the request that was left waiting."""
    import Xlib.display
    from PIL import Image
    from Xlib import X
    from Xlib.protocol import event

    import pystray
    from localserve.tray.xorg import dispatch_on_own_connection, wake_x_loop

    icon = pystray.Icon("race", Image.new("RGB", (16, 16)), "race")
    dispatch_on_own_connection(icon)
    changed, stop = [0], threading.Event()

    def setup(ic: Any) -> None:
        ic.visible = True
        for i in range(3000):
            ic.title = f"title {i}"
            if i % 100 == 0:
                ic.icon = Image.new("RGB", (16, 16), (i % 256, 0, 0))
            changed[0] = i + 1
        stop.set()

    def flood() -> None:
        d = Xlib.display.Display(desktop.display)
        window = d.create_resource_object("window", icon._window.id)
        while not stop.is_set():
            window.send_event(event.Expose(window=window, x=0, y=0, width=1, height=1, count=0),
                              event_mask=X.ExposureMask)
            d.flush()
            time.sleep(0.0005)
        d.close()

    flooder = threading.Thread(target=flood, daemon=True)
    runner = threading.Thread(target=icon.run, kwargs={"setup": setup}, daemon=True)
    flooder.start()
    runner.start()
    try:
        assert stop.wait(LIVE_S), f"the icon froze after {changed[0]} of 3000 changes"
    finally:
        stop.set()
        if changed[0] == 3000:
            icon.stop()
            wake_x_loop(icon._window.id)
    runner.join(10)
    assert not runner.is_alive()
