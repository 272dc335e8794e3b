"""Which LoRA adapters a model loads with, by id (issue 45, item 5): the ones its tag stores
(`add --lora`, store/lora.py), then the setting `model_loras`'s (config/loras.py). /lora-adapters,
`show` and the load all read this one list, so an id means the same adapter everywhere."""

from __future__ import annotations

from pathlib import Path

from ..config.loras import model_loras
from ..config.settings import Settings
from ..errors import GGUFError, ModelNotFoundError
from ..store.cache import InstalledModel
from ..store.lora import check_adapter


def lora_files(model: InstalledModel, settings: Settings) -> list[Path]:
    """The model's adapter files in id order."""
    return [*model.loras, *(path for _, path in model_loras(settings.model_loras, model.ref))]


def checked_lora_files(model: InstalledModel, settings: Settings) -> list[Path]:
    """lora_files, each checked before a load: a missing file (404) or one that is not a LoRA
    adapter for the model (400) is the user's mistake named (the setting's entry, or the stored
    file), not a failed load deep inside llama.cpp."""
    arch = model.facts.get("architecture")
    for path in model.loras:
        if not path.is_file():
            raise ModelNotFoundError(model.ref, message=f"{model.ref}: its LoRA adapter {path.name} is missing")
        check_adapter(path, f"{model.ref}'s LoRA adapter {path.name}", arch)
    for _, path in model_loras(settings.model_loras, model.ref):
        # Named by the file's name: the message reaches HTTP clients, who need not see the folders.
        entry = f"setting 'model_loras': the entry for {model.ref} names {path.name}"
        if not path.is_file():
            raise ModelNotFoundError(model.ref, message=f"{entry}, which is missing")
        try:
            check_adapter(path, path.name, arch)
        except GGUFError as e:
            raise GGUFError(f"{entry}: {e}") from None
    return lora_files(model, settings)
