"""How a model is split over several GPUs: settings `split_mode` and `tensor_split`, per model
`model_split_mode` / `model_tensor_split` (llama-server's --split-mode, --tensor-split).

`split_mode`: "layer" (the default: whole layers per card, llama.cpp's default), "row" (each
layer's rows over the cards; tensor parallelism where the backend has it) or "none" (one card).
`tensor_split`: the cards' shares, "3,1" (card 0 three parts, card 1 one); empty (the default):
shares proportional to each card's free memory, and only when one card cannot hold the model
(runtime/placement.py). Per model: "NAME[:TAG]=row", "NAME[:TAG]=3/1" (shares split by "/", as a
comma already separates a list's items in env and flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import ConfigError
from .per_model import per_model_value

SPLIT_MODES = ("layer", "row", "none")


@dataclass(frozen=True)
class SplitPrefs:
    """A model's split: the mode and the cards' shares (empty: by free memory, when needed)."""

    mode: str = "layer"
    shares: tuple[float, ...] = ()


def parse_tensor_split(value: str) -> tuple[float, ...]:
    """"3,1" or "3/1" -> (3.0, 1.0); "" -> (); ValueError saying why not."""
    text = str(value).strip().strip("[]()").replace("/", ",")  # a TOML list arrives as its text
    if not text:
        return ()
    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError("is not a list of numbers, one share per GPU (\"3,1\")") from None
    if any(s < 0 for s in shares) or not any(s > 0 for s in shares):
        raise ValueError("needs shares of 0 or more, at least one above 0")
    return shares


def _shares_text(value: str) -> str:
    parse_tensor_split(value)
    return value


def split_prefs(split_mode: str, tensor_split: str, mode_items: Iterable[str], split_items: Iterable[str],
                ref: str) -> SplitPrefs:
    """The split the model `ref` gets: its own items, else the settings."""
    mode = per_model_value(mode_items, ref, "model_split_mode", SPLIT_MODES) or split_mode.strip().lower()
    own = per_model_value(split_items, ref, "model_tensor_split", _shares_text)
    return SplitPrefs(mode, parse_tensor_split(own if own is not None else tensor_split))


def check_split(split_mode: str, tensor_split: str, mode_items: Iterable[str], split_items: Iterable[str]) -> None:
    """ConfigError naming the setting and entry that is not a split llama.cpp takes."""
    if split_mode.strip().lower() not in SPLIT_MODES:
        raise ConfigError(f"setting 'split_mode': {split_mode!r} is not one of {', '.join(SPLIT_MODES)}")
    try:
        parse_tensor_split(tensor_split)
    except ValueError as e:
        raise ConfigError(f"setting 'tensor_split': {tensor_split!r} {e}") from None
    split_prefs(split_mode, tensor_split, mode_items, split_items, "")  # every entry's form
