"""Values written into a systemd unit, a LaunchAgent, an XDG autostart entry or the Run key: no
control characters.

Each of those formats reads a value up to the end of its line: a newline inside a path (the home
directory, the interpreter's) would start a line of its own, `ExecStartPre=...` in a unit or a
second `Exec=` in an autostart entry, and no quoting either format has can keep it inside the
value. Such a path is legal on disk but never what a user meant, so the writers refuse it with
the value's role named (not its text: a path is the user's business, not the error's).
"""

from __future__ import annotations

import unicodedata
from typing import Iterable

from ..errors import ConfigError

# Cc: C0 controls (newline, tab, NUL, ...), DEL and C1 controls; Zl/Zp: the Unicode line and
# paragraph separators, which some readers also end a line at.
_REFUSED = {"Cc", "Zl", "Zp"}


def check_plain(values: Iterable[tuple[str, str]], target: str) -> None:
    """Raise ConfigError when any (role, value) holds a control character; `target` names the file
    or entry being written ("the systemd unit")."""
    for role, value in values:
        for i, ch in enumerate(value):
            if unicodedata.category(ch) in _REFUSED:
                raise ConfigError(f"{role} holds a control character ({ch!r} at position {i}); "
                                  f"refusing to write it into {target}: rename or move it, then run this again")
