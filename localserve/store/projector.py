"""A model's projector (llama.cpp's `mmproj` GGUF: vision, audio or both) stored as part of its tag
(issue 43).

The ggml-org GGUF repos publish a vision model as its language model and, beside it, the projector
that turns an image into embeddings in that model's space: `mmproj-<Model>-f16.gguf` (some repos
also a Q8_0 one). `pull` takes it with the model (pull/projector.py), `add PATH --mmproj FILE`
registers one in place; either way the tag's manifest records it under MANIFEST_KEY as
{"file", "sha256", "size"} (`file` a name in the tag's folder, or an absolute path with
`in_place`), and InstalledModel.mmproj is its path: what the engine's load takes as `mmproj`.

A projector is checked as any pulled file (sha256 against the listing's), and must be a GGUF whose
`general.architecture` is `clip` (llama.cpp's name for every projector type): a language model
given as a projector would fail only deep inside the engine worker's load. What it takes (`kinds`)
is read from its header: what `show`, /api/show and /props say before a load.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from ..errors import GGUFError

# The header flags llama.cpp's clip loader reads to know what a projector file holds.
_ENCODER_FLAGS = {"vision": "clip.has_vision_encoder", "audio": "clip.has_audio_encoder"}

MANIFEST_KEY = "mmproj"
PROJECTOR_ARCH = "clip"
# Which of several projectors a repo holds: full precision first (what llama.cpp's docs use;
# projectors are small next to their models), then the quantized ones.
PREFERRED = ("f16", "bf16", "f32", "q8_0")


def is_projector_name(file_name: str) -> bool:
    base = file_name.rsplit("/", 1)[-1].lower()
    return base.startswith("mmproj") and base.endswith(".gguf")


def _rank(file_name: str) -> tuple[int, int, str]:
    base = file_name.rsplit("/", 1)[-1].lower()
    for i, kind in enumerate(PREFERRED):
        if re.search(rf"(?<![a-z0-9]){kind}(?=\.gguf$)", base):
            return i, file_name.count("/"), file_name
    return len(PREFERRED), file_name.count("/"), file_name


def pick_projector(paths: list[str], wanted: str | None = None) -> str | None:
    """The projector file of a repo listing's `paths`: the one named `wanted` (the catalog's
    `mmproj`), else the preferred precision; None when the repo has none."""
    found = [p for p in paths if is_projector_name(p)]
    if wanted:
        named = [p for p in found if p.rsplit("/", 1)[-1] == wanted or p == wanted]
        return named[0] if named else None
    return min(found, key=_rank) if found else None


def check_projector(path: Path, label: str) -> None:
    """Refuse a file that is not a projector GGUF (GGUFError naming `label`)."""
    from .gguf_facts import read_gguf_metadata

    arch = read_gguf_metadata(path).get("general.architecture")
    if arch != PROJECTOR_ARCH:
        raise GGUFError(f"{label} is not a vision projector (its GGUF architecture is {str(arch)[:40]!r}, "
                        f"not {PROJECTOR_ARCH!r})")


def kinds(path: Path | None) -> frozenset[str]:
    """What the projector at `path` takes, "vision" and/or "audio", from its header; empty for
    None or a file that cannot be read (its load would fail the same way)."""
    if path is None:
        return frozenset()
    try:
        stat = path.stat()
    except OSError:
        return frozenset()
    return _kinds(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _kinds(path: Path, mtime_ns: int, size: int) -> frozenset[str]:  # keyed by the file's version
    from .gguf_facts import read_gguf_metadata

    try:
        meta = read_gguf_metadata(path)
    except (GGUFError, OSError):
        return frozenset()
    return frozenset(kind for kind, flag in _ENCODER_FLAGS.items() if meta.get(flag) is True)


def projector_path(manifest: dict[str, Any], tag_dir: Path) -> Path | None:
    """Where the manifest's projector is, or None when the tag has none."""
    entry = manifest.get(MANIFEST_KEY)
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        return None
    file = Path(entry["file"])
    if entry.get("in_place"):
        return file if file.is_absolute() else None
    if file.name != entry["file"] or file.name in ("", ".", ".."):
        return None  # a name, never a path: a manifest must not point out of its folder
    return tag_dir / file.name


def local_entry(path: Path, sha256: str) -> dict[str, Any]:
    """The manifest entry of a projector registered in place (`add --mmproj`)."""
    return {"file": str(path), "in_place": True, "size": path.stat().st_size, "sha256": sha256}
