"""Where a mixture-of-experts model's expert weights live: settings `cpu_moe`, `n_cpu_moe` and the
per-model `model_cpu_moe` (llama-server's --cpu-moe / --n-cpu-moe; backends/llamacpp/moe.py).

`cpu_moe`: "auto" (the default: the experts stay in RAM exactly when the whole model does not fit
the GPU but the rest does; runtime/placement.py), "on" (every layer's experts in RAM) or "off".
`n_cpu_moe = N` (N > 0): the first N layers' experts in RAM, whatever cpu_moe says.
`model_cpu_moe = ["NAME[:TAG]=VALUE"]` with VALUE auto, on, off or N, for that model only.
Resolved to one number of layers per model: None (auto), 0 (none), ALL_LAYERS or N.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError
from .per_model import per_model_value

ALL_LAYERS = -1  # every layer's experts (--cpu-moe)
_ON, _OFF = ("on", "true", "yes", "all"), ("off", "false", "no")


def parse_cpu_moe(value: str, numbers: bool = True) -> str:
    """"auto", "on", "off", or a layer count as digits where `numbers`; ValueError saying why not."""
    value = str(value).strip().lower()
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    if value == "auto" or (numbers and value.isdigit()):
        return value
    raise ValueError("is not auto, on, off" + (" or a number of layers" if numbers else ""))


def _layers(value: str) -> int | None:
    return None if value == "auto" else ALL_LAYERS if value == "on" else 0 if value == "off" else int(value)


def cpu_moe_layers(cpu_moe: str, n_cpu_moe: int, items: Iterable[str], ref: str) -> int | None:
    """The layers whose experts the model `ref` keeps in RAM: its model_cpu_moe item, else
    n_cpu_moe where positive, else cpu_moe. None: auto (placement decides)."""
    own = per_model_value(items, ref, "model_cpu_moe", parse_cpu_moe)
    if own is not None:
        return _layers(own)
    if n_cpu_moe > 0:
        return n_cpu_moe
    return _layers(parse_cpu_moe(cpu_moe, numbers=False))


def check_cpu_moe(cpu_moe: str, items: Iterable[str]) -> None:
    """ConfigError naming the setting and the entry whose value is not one cpu_moe takes."""
    try:
        parse_cpu_moe(cpu_moe, numbers=False)
    except ValueError as e:
        raise ConfigError(f"setting 'cpu_moe': {cpu_moe!r} {e}") from None
    per_model_value(items, "", "model_cpu_moe", parse_cpu_moe)  # every entry's form (the empty ref matches none)
