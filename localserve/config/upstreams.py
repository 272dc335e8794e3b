"""The `upstreams` setting: a list of TOML tables (or JSON in LOCALSERVE_UPSTREAMS), one per upstream.

    [[upstreams]]
    name = "gpu-box"
    url = "http://10.0.0.5:8000/v1"      # the OpenAI base URL, http(s) only
    api_key_env = "GPU_BOX_KEY"          # or api_key = "..." (the file should then be private)
    models = ["*"]                       # all of its /v1/models, or ["REMOTE_ID=ALIAS", "REMOTE_ID"]
    max_concurrency = 4                  # requests in flight there; the rest wait in our lanes
    priority_field = "priority"          # forward the lane as this body field (vLLM's priority policy)

Only the local user's config names upstreams: nothing a client sends can add one or change a URL.
The key is held with repr=False and shown masked by `localserve config`, never logged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

from ..errors import ConfigError

ALL_MODELS = "*"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEYS = {"name", "url", "api_key", "api_key_env", "models", "max_concurrency", "priority_field"}
# vLLM's priority policy serves lower values first; our lane ranks are 0 (interactive) .. 2 (batch).
DEFAULT_MAX_CONCURRENCY = 4


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    url: str  # normalised: no trailing slash
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    models: tuple[str, ...] = (ALL_MODELS,)  # "REMOTE" or "REMOTE=ALIAS", or "*"
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    priority_field: str | None = None

    @property
    def host(self) -> str:
        """scheme://host:port, the only origin requests (and redirects) may reach."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def exposes_all(self) -> bool:
        return ALL_MODELS in self.models

    def aliases(self) -> dict[str, str]:
        """local name -> remote model id, for the explicitly chosen models."""
        out = {}
        for item in self.models:
            if item == ALL_MODELS:
                continue
            remote, _, alias = item.partition("=")
            out[(alias or remote).strip()] = remote.strip()
        return out

    def config_names(self) -> list[str]:
        """The names the config gives: aliases, or "*@NAME" for all the upstream lists."""
        return list(self.aliases()) + ([f"*@{self.name}"] if self.exposes_all else [])

    def shown(self) -> str:
        """One line for `localserve config` / `upstream list`: never the key itself."""
        key = "key ****" if self.api_key else "no key"
        if self.api_key_env:
            key = f"key from ${self.api_key_env}" + ("" if self.api_key else " (unset)")
        return f"{self.name}={self.url} ({key}, models {','.join(self.models)}, max {self.max_concurrency})"

    def to_table(self) -> dict[str, Any]:
        """What `localserve upstream add` writes back (the key only if it came from the file)."""
        table: dict[str, Any] = {"name": self.name, "url": self.url}
        if self.api_key_env:
            table["api_key_env"] = self.api_key_env
        elif self.api_key:
            table["api_key"] = self.api_key
        table["models"] = list(self.models)
        table["max_concurrency"] = self.max_concurrency
        if self.priority_field:
            table["priority_field"] = self.priority_field
        return table


def check_url(url: str, where: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: url must be an http:// or https:// URL with a host")
    if parts.username or parts.password or parts.query or parts.fragment:
        # Credentials in a URL end up in logs and error messages; the key belongs in api_key.
        raise ConfigError(f"{where}: url must not hold credentials, a query or a fragment (use api_key)")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def parse_upstream(raw: Any, index: int) -> UpstreamConfig:
    where = f"upstreams[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a table (name, url, ...)")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    name = str(raw.get("name", ""))
    if not _NAME.match(name):
        raise ConfigError(f"{where}: name must be 1-64 letters, digits, '.', '_' or '-'")
    where = f"upstream {name!r}"
    models = raw.get("models", [ALL_MODELS])
    if isinstance(models, str):
        models = models.split(",")
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{where}: models must be a list of strings")
    models = [m.strip() for m in models if m.strip()] or [ALL_MODELS]
    limit = raw.get("max_concurrency", DEFAULT_MAX_CONCURRENCY)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
        raise ConfigError(f"{where}: max_concurrency must be an integer from 1 to 10000")
    key = raw.get("api_key")
    env = raw.get("api_key_env")
    if key is not None and not isinstance(key, str) or env is not None and not isinstance(env, str):
        raise ConfigError(f"{where}: api_key and api_key_env must be strings")
    field_name = raw.get("priority_field")
    if field_name is not None and not (isinstance(field_name, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", field_name)):
        raise ConfigError(f"{where}: priority_field must be a plain field name")
    return UpstreamConfig(name=name, url=check_url(str(raw.get("url", "")), where), api_key=(key or "").strip() or None,
                          api_key_env=env or None, models=tuple(models), max_concurrency=limit,
                          priority_field=field_name)


def parse_upstreams(value: Any) -> tuple[UpstreamConfig, ...]:
    """The setting's value from TOML (a list of tables) or the environment (a JSON array)."""
    if isinstance(value, tuple) and all(isinstance(u, UpstreamConfig) for u in value):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise ConfigError("upstreams: the environment value must be a JSON array of tables") from None
    if not isinstance(value, list):
        raise ConfigError("upstreams must be a list of tables ([[upstreams]] in config.toml)")
    out = tuple(parse_upstream(raw, i) for i, raw in enumerate(value))
    names = [u.name for u in out]
    if len(set(names)) != len(names):
        raise ConfigError("upstreams: every upstream needs its own name")
    return out


def resolve_keys(upstreams: tuple[UpstreamConfig, ...], environ: Mapping[str, str]) -> tuple[UpstreamConfig, ...]:
    """Fill each api_key from the variable api_key_env names (config.py is the one environment reader)."""
    out = []
    for u in upstreams:
        if u.api_key_env and environ.get(u.api_key_env, "").strip():
            u = UpstreamConfig(**{**u.__dict__, "api_key": environ[u.api_key_env].strip()})
        out.append(u)
    return tuple(out)
