"""KV-cache element types, K and V apart: the names llama.cpp takes (ggml's, as llama-server's
`--cache-type-k/-v`), what each costs, and the combinations llama.cpp refuses.

A KV type is written "K/V" ("q8_0/f16"), or one name for both ("q8_0"); `kv_cache_type` and the
per-model `model_kv_cache_type = ["NAME[:TAG]=K/V"]` take it (per_model.py). Checked when the
settings load, so a combination llama.cpp would refuse stops the daemon at start with its reason,
never a model at its load.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError
from .per_model import per_model_value

# Bytes per element: ggml's block sizes over the 32 values of a block (q8_0: 34 bytes, q4_0: 18, ...).
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                 "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
_PLAIN = ("f32", "f16", "bf16")  # the rest are block-quantized
FLASH_OFF_REASON = ("llama.cpp refuses a quantized V cache without flash attention (\"quantized V cache requires "
                    "flash_attn to be enabled\"), and kv_layout = \"streams\" with flash_attention = false keeps "
                    "it off for exact answers")


def kv_pair(kv_type: str) -> tuple[str, str]:
    """(K, V) of a checked KV type: "q8_0/f16" -> ("q8_0", "f16"), "q8_0" -> ("q8_0", "q8_0")."""
    k, sep, v = kv_type.partition("/")
    return k, (v if sep else k)


def kv_element_bytes(kv_type: str) -> float:
    """Bytes per cached element, K and V averaged (they hold the same number of elements)."""
    k, v = kv_pair(kv_type)
    return (KV_TYPE_BYTES[k] + KV_TYPE_BYTES[v]) / 2


def needs_flash_attention(kv_type: str) -> bool:
    """A quantized V is stored untransposed, which only the flash-attention kernel reads."""
    return kv_pair(kv_type)[1] not in _PLAIN


def parse_kv_type(value: str) -> str:
    """`value` as "K/V" (or one name where both are the same); ValueError saying why not."""
    parts = [p.strip().lower() for p in value.split("/")]
    if len(parts) > 2 or not all(parts):
        raise ValueError("is not K/V, one KV type for K and one for V")
    unknown = [p for p in parts if p not in KV_TYPE_BYTES]
    if unknown:
        raise ValueError(f"names {unknown[0]!r}, not a KV type llama.cpp offers ({', '.join(KV_TYPE_BYTES)})")
    k, v = parts[0], parts[-1]
    return k if k == v else f"{k}/{v}"


def model_kv_type(items: Iterable[str], ref: str) -> str | None:
    """The KV type `model_kv_cache_type` gives the model `ref`, or None (the kv_cache_type setting)."""
    return per_model_value(items, ref, "model_kv_cache_type", parse_kv_type)


def check_kv_types(kv_cache_type: str, items: Iterable[str], kv_layout: str, flash_attention: bool) -> None:
    """ConfigError naming the setting and entry where a KV type is unknown or a combination
    llama.cpp refuses: a quantized V where flash attention stays off."""
    items = tuple(items)
    model_kv_type(items, "")  # every entry's form and types (the empty ref matches none)
    named = [("model_kv_cache_type", item, item.partition("=")[2]) for item in items]
    if kv_cache_type.strip().lower() != "auto":
        try:
            parse_kv_type(kv_cache_type)
        except ValueError as e:
            raise ConfigError(f"setting 'kv_cache_type': {kv_cache_type!r} {e}") from None
        named.append(("kv_cache_type", kv_cache_type, kv_cache_type))
    if kv_layout.strip().lower() != "streams" or flash_attention:
        return
    for setting, entry, kv in named:
        if needs_flash_attention(parse_kv_type(kv)):
            raise ConfigError(f"setting '{setting}': {entry!r}: {FLASH_OFF_REASON}; give V as {', '.join(_PLAIN)}, "
                              "or set kv_layout auto or unified")
