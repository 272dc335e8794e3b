"""`model_loras = ["NAME[:TAG]=FILE"]`: LoRA adapters given per model in the settings (issue 45, item 5).

Unlike the one-value per-model settings (per_model.py) a model may have several: every item naming
it counts, in the order written, after the adapters its tag stores (`add --lora`, store/lora.py);
together they are the model's adapter ids 0, 1, ... An item naming the tag and one naming only the
model both count. FILE is a path (`~` is the home folder), kept as written, never lowercased.
Checked for form when the settings load; the file itself is checked at the model's load, which
names the entry where it is missing or not a LoRA adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..errors import ConfigError

SETTING = "model_loras"


def _split(item: str) -> tuple[str, str, str]:
    target, sep, file = item.partition("=")
    name, _, tag = target.strip().partition(":")
    if not sep or not name.strip() or not file.strip():
        raise ConfigError(f"setting '{SETTING}': {item!r} is not NAME[:TAG]=FILE")
    return name.strip().lower(), tag.strip().lower(), file.strip()


def check_model_loras(items: Iterable[str]) -> None:
    """ConfigError naming the first item that is not NAME[:TAG]=FILE."""
    for item in items:
        _split(item)


def model_loras(items: Iterable[str], ref: str) -> list[tuple[str, Path]]:
    """(the item, its file) for each item naming the model `ref` (NAME:TAG), in order."""
    name, _, tag = ref.lower().partition(":")
    found = []
    for item in items:
        t_name, t_tag, file = _split(item)
        if t_name == name and (not t_tag or t_tag == tag):
            found.append((item, Path(file).expanduser()))
    return found
