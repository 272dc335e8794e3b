"""Settings given per model as "NAME[:TAG]=VALUE" items (`model_backends`, `model_speculative`):
an item naming the tag wins over one naming the model; a bare name covers all its tags."""

from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError


def per_model_value(items: Iterable[str], ref: str, setting: str, allowed: Iterable[str]) -> str | None:
    """The value `items` give the model `name:tag`, lowercased, or None when none names it; an
    item that is not NAME[:TAG]=VALUE with VALUE in `allowed` is a ConfigError naming `setting`."""
    allowed = tuple(allowed)
    name, _, tag = ref.partition(":")
    matched: dict[bool, str] = {}
    for item in items:
        target, sep, value = item.partition("=")
        value = value.strip().lower()
        if not sep or not target.strip() or value not in allowed:
            raise ConfigError(f"setting '{setting}': {item!r} is not NAME[:TAG]=VALUE with VALUE one of "
                              f"{', '.join(allowed)}")
        t_name, _, t_tag = target.strip().partition(":")
        if t_name.lower() == name.lower() and (not t_tag or t_tag.lower() == tag.lower()):
            matched[bool(t_tag)] = value
    return matched.get(True, matched.get(False))
