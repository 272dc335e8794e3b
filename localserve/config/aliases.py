"""The `model_aliases` setting: model names clients send, mapped to the models served here.

Coding agents name models they were built for, never ours: Claude Code asks for `claude-*` names
for every tier and its subagents, Codex for `gpt-*`. An item is `PATTERN=MODEL`, the pattern a
shell-style glob (`*`, `?`, `[...]`) matched without regard to case, e.g. `claude-*=smollm2-135m`.
A name that is itself served (installed, or an upstream's) is never aliased, so a pattern cannot
shadow a real model; otherwise the first matching item wins, and its MODEL is looked up as given
(aliases do not chain).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable

from ..errors import ConfigError

SETTING = "model_aliases"


def parse_alias(item: str) -> tuple[str, str]:
    """(pattern, model) of one `PATTERN=MODEL` item, or ConfigError."""
    pattern, sep, model = item.partition("=")
    pattern, model = pattern.strip(), model.strip()
    if not sep or not pattern or not model:
        raise ConfigError(f"setting {SETTING!r}: {item!r} is not PATTERN=MODEL (e.g. claude-*=smollm2-135m)")
    return pattern, model


def alias_target(name: str, items: Iterable[str]) -> str | None:
    """The model the first item whose pattern matches `name` maps it to, or None."""
    for item in items:
        pattern, model = parse_alias(item)
        if fnmatch.fnmatchcase(name.lower(), pattern.lower()):
            return model
    return None
