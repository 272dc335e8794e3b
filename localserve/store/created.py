"""Models made by Ollama's /api/create and /api/copy: a new name for a model served here, with an
overlay (a system prompt, default options, a chat template), as a Modelfile's FROM, SYSTEM,
PARAMETER and TEMPLATE make one. No weights are copied: the name resolves to its `source`, an
installed model or an upstream's (runtime/resolve.py), and the Ollama dialect lays the overlay
over each request naming it (api/ollama_models.py).

They live in one small JSON file in the data folder, written atomically; a created name never
shadows an installed model (the create is refused), and removing one never touches its source.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config.settings import Settings
from ..errors import InvalidRequestError
from .cache import atomic_write_json
from .names import name_to_dir, safe_component

FILE_NAME = "created-models.json"
MAX_CREATED = 1024  # names a user makes by hand; a bound so a client cannot grow the file forever


def created_key(name: str) -> str:
    """`name:tag` lowercased, `latest` where no tag is named (as Ollama clients name models)."""
    base, _, tag = name.strip().partition(":")
    return f"{base}:{tag or 'latest'}".lower()


@dataclass
class CreatedModel:
    name: str  # as the client wrote it, with its tag
    source: str  # the model it serves: installed or an upstream's, never another created one
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # Ollama options, under the request's own
    template: str | None = None  # a Jinja chat template in place of the model's own
    modified: float = field(default_factory=time.time)


class CreatedModels:
    """The created models of one data folder. Reads go to the file each time it changed, so the
    CLI's and the daemon's views agree; writes hold a lock within this process."""

    _write_lock = threading.Lock()

    def __init__(self, settings: Settings):
        self.path: Path = settings.home / FILE_NAME

    def all(self) -> dict[str, CreatedModel]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return {}
        out = {}
        for key, item in (raw.get("models") or {}).items() if isinstance(raw, dict) else ():
            try:
                out[key] = CreatedModel(**item)
            except TypeError:  # a hand-edited entry with other fields: left out, not a crash
                continue
        return out

    def get(self, name: str) -> CreatedModel | None:
        return self.all().get(created_key(name))

    def put(self, model: CreatedModel) -> None:
        base, _, tag = created_key(model.name).partition(":")
        name_to_dir(base), safe_component(tag, "tag")  # the names pull accepts (InvalidNameError)
        with self._write_lock:
            models = self.all()
            if created_key(model.name) not in models and len(models) >= MAX_CREATED:
                raise InvalidRequestError(f"at most {MAX_CREATED} created models; delete some first", param="model")
            models[created_key(model.name)] = model
            self._write(models)

    def remove(self, name: str) -> CreatedModel | None:
        with self._write_lock:
            models = self.all()
            gone = models.pop(created_key(name), None)
            if gone is not None:
                self._write(models)
            return gone

    def _write(self, models: dict[str, CreatedModel]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"models": {k: asdict(m) for k, m in models.items()}})
