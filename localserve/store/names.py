"""A model name or tag as a path component: the one check every path built from a name goes through.

A name is the one thing a remote client (Ollama's /api/pull, /api/delete) controls that becomes a
path, so it is the door a traversal attack would use. Its own room, under both the cache and the
catalog, which each check names.
"""

from __future__ import annotations

import os
import unicodedata

from ..errors import InvalidNameError

MAX_COMPONENT_LENGTH = 128
# Characters Windows refuses in file names; refusing them everywhere keeps a cache portable.
_WINDOWS_FORBIDDEN = set('<>:"|?*')
_WINDOWS_DEVICES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


def safe_component(text: str, what: str = "name") -> str:
    """Return `text` if it is safe as ONE path component under the cache, else raise InvalidNameError.

    Rejects: empty, overlong, `.`/`..`, path separators, absolute paths and drive letters, control
    characters, characters Windows forbids, leading dots (our own lock/partial files start with a
    dot), trailing dots/spaces (Windows silently strips them, so two names would share a folder),
    and DOS device names.
    """
    if not isinstance(text, str) or text == "":
        raise InvalidNameError(f"model {what} must not be empty")
    shown = text[:40].encode("unicode_escape").decode("ascii")
    if len(text) > MAX_COMPONENT_LENGTH:
        raise InvalidNameError(f"model {what} is longer than {MAX_COMPONENT_LENGTH} characters")
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in text):
        raise InvalidNameError(f"model {what} {shown!r} contains control characters")
    if "/" in text or "\\" in text or os.sep in text or (os.altsep and os.altsep in text):
        raise InvalidNameError(f"model {what} {shown!r} must not contain path separators")
    if text in (".", "..") or text.startswith("."):
        raise InvalidNameError(f"model {what} {shown!r} must not start with a dot")
    if _WINDOWS_FORBIDDEN & set(text):
        raise InvalidNameError(f"model {what} {shown!r} contains a character not allowed in file names")
    if text.endswith((" ", ".")) or text != text.strip():
        raise InvalidNameError(f"model {what} {shown!r} must not start or end with spaces or dots")
    if text.split(".")[0].lower() in _WINDOWS_DEVICES:
        raise InvalidNameError(f"model {what} {shown!r} is a reserved device name")
    return text


def name_to_dir(name: str) -> str:
    """Directory name for a model name. `hf.co/org/repo` names keep their readable form with `--`
    in place of `/`; every resulting component is validated."""
    parts = name.split("/")
    for part in parts:
        safe_component(part, "name")
    return safe_component("--".join(parts), "name")
