"""Settings given per model as "NAME[:TAG]=VALUE" items (`model_backends`, `model_speculative`,
`model_kv_cache_type`): an item naming the tag wins over one naming the model; a bare name covers
all its tags."""

from __future__ import annotations

from typing import Callable, Iterable

from ..errors import ConfigError


def per_model_value(items: Iterable[str], ref: str, setting: str,
                    allowed: Iterable[str] | Callable[[str], str]) -> str | None:
    """The value `items` give the model `name:tag`, lowercased, or None when none names it; an
    item that is not NAME[:TAG]=VALUE with VALUE in `allowed` is a ConfigError naming `setting`
    and the item. `allowed` may be a parser instead: it returns the value as kept, or raises
    ValueError saying what is wrong with it."""
    parse = allowed if callable(allowed) else None
    choices = () if parse else tuple(allowed)
    name, _, tag = ref.partition(":")
    matched: dict[bool, str] = {}
    for item in items:
        target, sep, value = item.partition("=")
        value = value.strip().lower()
        if not sep or not target.strip():
            raise ConfigError(f"setting '{setting}': {item!r} is not NAME[:TAG]=VALUE")
        if parse is not None:
            try:
                value = parse(value)
            except ValueError as e:
                raise ConfigError(f"setting '{setting}': {item!r}: the value {e}") from None
        elif value not in choices:
            raise ConfigError(f"setting '{setting}': {item!r} is not NAME[:TAG]=VALUE with VALUE one of "
                              f"{', '.join(choices)}")
        t_name, _, t_tag = target.strip().partition(":")
        if t_name.lower() == name.lower() and (not t_tag or t_tag.lower() == tag.lower()):
            matched[bool(t_tag)] = value
    return matched.get(True, matched.get(False))
