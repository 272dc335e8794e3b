"""The tray's menu, tooltip and icon as pure functions of recorded daemon states (answers of
/api/dashboard/state and /api/tags as the daemon sends them): stopped, idle, busy, pulling, key set."""

from __future__ import annotations

from localserve.tray.icon import COLOURS, icon_image
from localserve.tray.menu import SEPARATOR, build_menu, tooltip
from localserve.tray.state import DaemonState, from_snapshot

URL = "http://127.0.0.1:11480"
TAGS = {"models": [{"name": "smollm2-135m:Q4_1"}, {"name": "qwen2.5-0.5b:Q4_K_M"}]}
LOADED = {"name": "smollm2-135m:Q4_1", "state": "loaded", "running": 0, "busy": False, "tokens_per_s": 0.0,
          "waiting": {"interactive": 0, "default": 0, "batch": 0}}
IDLE = {"time": 1.0, "models": [LOADED], "pulls": 0, "api_key": False}
BUSY = {"time": 1.0, "pulls": 0, "api_key": False, "models": [
    dict(LOADED, running=4, busy=True, tokens_per_s=181.5, waiting={"interactive": 1, "default": 3, "batch": 7},
         running_by_lane={"interactive": 1, "default": 3, "batch": 0})],
    "summary": "1 model loaded · running: interactive 1, default 3, batch 0"}
PULLING = {"time": 1.0, "models": [], "pulls": 1, "api_key": False}
KEYED = dict(IDLE, api_key=True)


def texts(items):
    return [i.text for i in items]


def find(items, text):
    return next(i for i in items if i.text == text)


def test_stopped():
    state = DaemonState("stopped", URL)
    menu = build_menu(state)
    assert not find(menu, "Open dashboard").enabled and not find(menu, "Models").enabled
    assert "Start server" in texts(menu) and "Stop server" not in texts(menu)
    assert "Server stopped" in texts(menu) and "Copy API key" not in texts(menu)
    quit_items = find(menu, "Quit").children
    assert find(quit_items, "Quit, keep the server running").enabled
    assert not find(quit_items, "Quit and stop the server").enabled
    assert tooltip(state) == "localserve: stopped"
    assert icon_image("stopped").getpixel((2, 32))[:3] == COLOURS["stopped"]


def test_idle():
    state = from_snapshot(URL, IDLE, TAGS, autostart=False)
    assert state.status == "idle" and state.loaded == ("smollm2-135m:Q4_1",)
    menu = build_menu(state)
    assert texts(menu)[:4] == ["Open dashboard", "Chat", "Models", "Pull a model…"]
    assert find(menu, "Open dashboard").default and find(menu, "Chat").arg == "/#chat"
    assert find(menu, "Pull a model…").arg == "/#pull"
    models = find(menu, "Models").children
    assert [(m.text, m.checked) for m in models if m.action == "toggle_model"] == [
        ("qwen2.5-0.5b:Q4_K_M", False), ("smollm2-135m:Q4_1", True)]
    assert SEPARATOR in models and find(models, "Unload all").enabled
    assert find(menu, "Queue: interactive 0, default 0, batch 0").enabled is False
    assert find(menu, "Start at login").checked is False and "Stop server" in texts(menu)
    assert tooltip(state) == "localserve: idle\nsmollm2-135m:Q4_1\n0 tok/s"


def test_busy():
    state = from_snapshot(URL, BUSY, TAGS, autostart=True)
    assert state.status == "generating" and state.tokens_per_s == 181.5
    menu = build_menu(state)
    assert "Queue: interactive 1, default 3, batch 7" in texts(menu)
    # The daemon's one line, as the dashboard's header shows it, right under the queue.
    line = find(menu, "1 model loaded · running: interactive 1, default 3, batch 0")
    assert not line.enabled and texts(menu).index(line.text) == texts(menu).index("Queue: interactive 1, default 3, batch 7") + 1
    assert find(menu, "Start at login").checked is True
    assert "181.5 tok/s" in tooltip(state)
    assert icon_image(state.status).getpixel((2, 32))[:3] == COLOURS["generating"]


def test_pulling_with_nothing_loaded():
    state = from_snapshot(URL, PULLING, TAGS, autostart=False)
    assert state.status == "pulling" and state.loaded == ()
    models = find(build_menu(state), "Models").children
    assert not any(m.checked for m in models if m.action) and not find(models, "Unload all").enabled
    assert "1 pull(s) running" in tooltip(state) and "no model loaded" in tooltip(state)


def test_key_set_adds_copy_key():
    assert "Copy API key" not in texts(build_menu(from_snapshot(URL, IDLE, TAGS, autostart=False)))
    menu = build_menu(from_snapshot(URL, KEYED, TAGS, autostart=False))
    assert find(menu, "Copy API key").action == "copy_key"
    assert texts(menu).index("Copy API key") == texts(menu).index("Copy API endpoint") + 1


def test_no_models_installed():
    models = find(build_menu(from_snapshot(URL, PULLING, {"models": []}, autostart=False)), "Models").children
    assert models[0].text == "No models installed" and not models[0].enabled


def test_memory_held_now_and_at_most():
    """A daemon's rows carry what each model holds now and the most it may grow to (issue 42):
    the tooltip names both per model, the menu sums them; "?" where one could not be measured."""
    measured = dict(LOADED, memory_held_bytes=196_341_760, memory_max_bytes=3_328_949_504)
    state = from_snapshot(URL, dict(IDLE, models=[measured]), TAGS, autostart=False)
    assert state.memory == {"smollm2-135m:Q4_1": (196_341_760, 3_328_949_504)}
    assert tooltip(state) == "localserve: idle\nsmollm2-135m:Q4_1 · 187.2 MiB (at most 3.1 GiB)\n0 tok/s"
    assert "Memory: 187.2 MiB now, at most 3.1 GiB" in texts(build_menu(state))
    other = dict(LOADED, name="qwen2.5-0.5b:Q4_K_M", memory_held_bytes=None, memory_max_bytes=1 << 30)
    both = from_snapshot(URL, dict(IDLE, models=[measured, other]), TAGS, autostart=False)
    assert "Memory: ? now, at most 4.1 GiB" in texts(build_menu(both))
    assert "qwen2.5-0.5b:Q4_K_M · ? (at most 1.0 GiB)" in tooltip(both)
