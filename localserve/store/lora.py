"""A model's LoRA adapters (llama.cpp's adapter GGUFs) stored as part of its tag (issue 45, item 5).

`add PATH --lora FILE` (repeatable) registers adapters in place beside the model, as `--mmproj`
registers a projector (projector.py): the tag's manifest records them under MANIFEST_KEY as a list of
{"file", "sha256", "size", "in_place"}, in the order given, which is their ids (a request's
`lora: [{"id", "scale"}]`, as llama-server numbers its `--lora` files), and InstalledModel.loras is
their paths. The setting `model_loras` adds more per model (config/loras.py), after these.

An adapter is checked when it is added: a GGUF whose `general.type` is `adapter` and
`adapter.type` is `lora`, for the model's own architecture. llama.cpp refuses anything else only
inside the engine worker's load, where it is a failed load instead of the user's mistake named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import GGUFError

MANIFEST_KEY = "loras"


def check_adapter(path: Path, label: str, architecture: str | None) -> None:
    """Refuse a file that is not a LoRA adapter GGUF for `architecture` (GGUFError naming `label`)."""
    from .gguf_facts import read_gguf_metadata

    meta = read_gguf_metadata(path)
    kind, adapter, arch = meta.get("general.type"), meta.get("adapter.type"), meta.get("general.architecture")
    if kind != "adapter" or adapter != "lora":
        raise GGUFError(f"{label} is not a LoRA adapter (its GGUF general.type is {str(kind)[:40]!r} and "
                        f"adapter.type {str(adapter)[:40]!r}, not 'adapter' and 'lora')")
    if architecture and arch != architecture:
        raise GGUFError(f"{label} is a LoRA adapter for {str(arch)[:40]!r}, not for this model's "
                        f"architecture {architecture!r}")


def adapter_paths(manifest: dict[str, Any]) -> list[Path]:
    """The manifest's adapters in id order (entries that are not absolute paths are skipped: a
    manifest must not point anywhere it did not register)."""
    entries = manifest.get(MANIFEST_KEY)
    if not isinstance(entries, list):
        return []
    return [Path(e["file"]) for e in entries
            if isinstance(e, dict) and isinstance(e.get("file"), str) and Path(e["file"]).is_absolute()]


def local_entries(paths: list[Path], sha256_file: Any) -> list[dict[str, Any]]:
    """The manifest entries of adapters registered in place (`add --lora`)."""
    return [{"file": str(p), "in_place": True, "size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]
