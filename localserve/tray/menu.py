"""The tray's menu as data: a pure function of DaemonState, so every state can be checked without a
display. `app.py` turns the items into pystray's; an item's `action` names what actions.py does."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.requests import LANES
from ..runtime.memory import format_bytes
from .state import DaemonState


@dataclass(frozen=True)
class Item:
    text: str
    action: str | None = None  # None: a read-only line or a submenu
    arg: str | None = None
    checked: bool | None = None  # None: not a check item
    enabled: bool = True
    children: tuple["Item", ...] = ()
    default: bool = False  # what a click on the icon does


SEPARATOR = Item("-")


def queue_line(state: DaemonState) -> str:
    return "Queue: " + ", ".join(f"{lane} {state.queued.get(lane, 0)}" for lane in LANES)


def build_menu(state: DaemonState) -> tuple[Item, ...]:
    up = state.status != "stopped"
    models = tuple(Item(name, "toggle_model", name, checked=name in state.loaded, enabled=up)
                   for name in state.installed)
    if not models:
        models = (Item("No models installed", enabled=False),)
    items = [
        Item("Open dashboard", "open", "/", enabled=up, default=True),
        Item("Chat", "open", "/#chat", enabled=up),
        Item("Models", children=models + (SEPARATOR, Item("Unload all", "unload_all", enabled=bool(state.loaded))),
             enabled=up),
        Item("Pull a model…", "open", "/#pull", enabled=up),
        Item(queue_line(state) if up else "Server stopped", enabled=False),
        *([Item(state.summary, enabled=False)] if up and state.summary else []),
        *([Item(memory_line(state), enabled=False)] if up and state.memory else []),
        SEPARATOR,
        Item("Copy API endpoint", "copy_endpoint"),
    ]
    if state.api_key_set:
        items.append(Item("Copy API key", "copy_key"))
    items += [
        Item("Start at login", "toggle_autostart", checked=state.autostart),
        Item("Show logs", "show_logs"),
        Item("Stop server", "stop_server") if up else Item("Start server", "start_server"),
        SEPARATOR,
        # Quitting asks whether the daemon goes too: the answer is the submenu item chosen.
        Item("Quit", children=(Item("Quit, keep the server running", "quit"),
                               Item("Quit and stop the server", "quit_and_stop", enabled=up))),
    ]
    return tuple(items)


def memory_line(state: DaemonState) -> str:
    """The loaded models' memory together: held now (KV is committed as requests use it) and the
    most it may grow to; "?" now where a model's engine could not be measured."""
    held = [h for h, _ in state.memory.values()]
    now = "?" if None in held else format_bytes(sum(h or 0 for h in held))
    return f"Memory: {now} now, at most {format_bytes(sum(m for _, m in state.memory.values()))}"


def _model_line(state: DaemonState, name: str) -> str:
    if name not in state.memory:
        return name
    held, most = state.memory[name]
    return f"{name} · {'?' if held is None else format_bytes(held)} (at most {format_bytes(most)})"


def tooltip(state: DaemonState) -> str:
    if state.status == "stopped":
        return f"localserve: stopped ({state.error})"[:120] if state.error else "localserve: stopped"
    if state.status == "error":
        return f"localserve: error ({state.error})"[:120]
    lines = [f"localserve: {state.status}"]
    lines += [_model_line(state, name) for name in state.loaded] or ["no model loaded"]
    lines.append(f"{state.tokens_per_s:g} tok/s")
    if state.pulls:
        lines.append(f"{state.pulls} pull(s) running")
    return "\n".join(lines)
