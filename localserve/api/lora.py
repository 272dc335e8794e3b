"""A request's LoRA adapters in llama-server's shape (issue 45, item 5): `lora: [{"id": N, "scale": S}]`,
in the OpenAI bodies (chat and completions, as llama-server and vLLM-style clients send it beside the
OpenAI fields) and llama.cpp's `/completion` and `/infill`.

As llama-server: a request without `lora` runs with all the model's adapters at scale 1; one with
`lora` runs with the scales it names and the model's other adapters off (`[]`: the base model).
The ids are the model's adapters in order (GET /lora-adapters lists them). The body's shape is
checked before any load; the ids against the model once it is known, a 400 naming the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..protocol.engine import ModelEngine
from ..protocol.requests import LoraSet, lora_set
from .validation import Body, invalid

MAX_LORA_ITEMS = 64  # a model with more adapters than this is not a desktop's


def parse_lora(body: Body, model: str) -> list[tuple[int, float]] | None:
    """The `lora` field as (id, scale) pairs, None when absent; a 400 naming the requested `model`
    on any other shape."""
    value = body.raw("lora")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_LORA_ITEMS:
        raise invalid(f"'lora' must be a list of at most {MAX_LORA_ITEMS} objects {{\"id\", \"scale\"}} "
                      f"(model {model})", "lora")
    pairs = []
    for item in value:
        adapter, scale = (item.get("id"), item.get("scale")) if isinstance(item, dict) else (None, None)
        if not _is_int(adapter) or not _is_number(scale):
            raise invalid(f"'lora' items must be objects {{\"id\": integer, \"scale\": number}} (got "
                          f"{str(item)[:60]}; model {model})", "lora")
        pairs.append((adapter, float(scale)))
    return pairs


def checked_lora(pairs: list[tuple[int, float]] | None, engine: ModelEngine) -> LoraSet | None:
    """`pairs` checked against the loaded model (a 400 naming it); None stays None (its own)."""
    if pairs is None:
        return None
    return lora_set(pairs, len(engine.info.loras), engine.name)


def refuse_remote_lora(pairs: list[tuple[int, float]] | None, model: str) -> None:
    """A remote model's adapters are its server's business: naming ours there is a mistake."""
    if pairs:
        raise invalid(f"the model {model} is a remote model: 'lora' names adapters of local models only", "lora")


def adapters_body(files: Sequence[Path]) -> list[dict[str, Any]]:
    """llama-server's GET /lora-adapters list: id, path and the scale a request without `lora`
    gets. The path is the file's name: as /api/show, nothing says where on this machine it is."""
    return [{"id": i, "path": Path(f).name, "scale": 1.0} for i, f in enumerate(files)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
