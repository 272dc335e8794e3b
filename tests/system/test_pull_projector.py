"""Vision projectors in the store (issue 43): `pull` of a Hub repo brings its `mmproj-*.gguf` into the
same tag, verified like the model (a wrong digest or a file that is not a projector fails the pull
and leaves nothing installed), a catalog variant can name the projector or say "none", and
`localserve add PATH --mmproj FILE` registers one in place; the manifest records it and
InstalledModel.mmproj (what the engine's load takes as `mmproj`), `show` and /api/show-side
descriptions say it. Against the real local Hub-like server of test_pull.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from localserve.errors import ChecksumMismatchError, DownloadError, GGUFError
from localserve.pull import pull_model
from localserve.runtime.describe import summary
from localserve.store.cache import ModelStore
from projector_gguf import projector_bytes
from test_pull import FAST_RETRY, PROJECTOR, PROJECTOR_NAME, Served, hub_listing, make_settings, run_cli
from test_pull import server  # noqa: F401  (the fixture)

MODEL_FILE = "SmolVLM-256M-Instruct-Q8_0.gguf"


def lfs(path: str, data: bytes) -> dict[str, Any]:
    return {"type": "file", "oid": "0" * 40, "size": len(data), "path": path,
            "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}


def test_pull_brings_the_repos_projector_into_the_tag(tmp_path, server, smollm2_gguf):  # noqa: F811
    data = smollm2_gguf.read_bytes()
    q8 = projector_bytes()[:-8] + b"\0" * 8  # another projector file the repo offers: not the one picked
    listing = hub_listing(MODEL_FILE, data, extra=[lfs("mmproj-model-Q8_0.gguf", q8)])
    server.hub["ggml-org/SmolVLM-256M-Instruct-GGUF"] = listing
    server.files[MODEL_FILE] = Served(data)
    settings = make_settings(tmp_path, server)

    model = pull_model("hf.co/ggml-org/SmolVLM-256M-Instruct-GGUF:Q8_0", settings, retry=FAST_RETRY)

    assert model.mmproj == model.path.parent / PROJECTOR_NAME  # f16 preferred over Q8_0
    assert model.mmproj.read_bytes() == PROJECTOR
    entry = model.manifest["mmproj"]
    assert entry["file"] == PROJECTOR_NAME and entry["sha256"] == hashlib.sha256(PROJECTOR).hexdigest()
    assert entry["size"] == len(PROJECTOR)
    assert server.requests_for("mmproj-model-Q8_0.gguf") == []
    again = ModelStore(settings).find("hf.co/ggml-org/SmolVLM-256M-Instruct-GGUF:Q8_0")
    assert again.mmproj == model.mmproj
    assert summary(again)["vision"] is True and summary(again)["mmproj"] == str(model.mmproj)
    assert not list(model.path.parent.glob("*.partial*"))


def test_a_repo_without_projector_pulls_as_before(tmp_path, server, smollm2_gguf):  # noqa: F811
    data = smollm2_gguf.read_bytes()
    server.hub["TestOrg/Text-GGUF"] = [item for item in hub_listing(MODEL_FILE, data)
                                       if not item["path"].startswith("mmproj")]
    server.files[MODEL_FILE] = Served(data)
    model = pull_model("hf.co/TestOrg/Text-GGUF:Q8_0", make_settings(tmp_path, server), retry=FAST_RETRY)
    assert model.mmproj is None and "mmproj" not in model.manifest and summary(model)["vision"] is False


@pytest.mark.parametrize("served, error", [
    (PROJECTOR[:-1] + bytes([PROJECTOR[-1] ^ 1]), ChecksumMismatchError),  # the listing's sha256 is another
    (None, DownloadError),  # the projector is missing on the server
])
def test_a_bad_projector_fails_the_pull_and_installs_nothing(tmp_path, server, smollm2_gguf, served, error):  # noqa: F811
    data = smollm2_gguf.read_bytes()
    server.hub["TestOrg/Broken-GGUF"] = hub_listing(MODEL_FILE, data)
    server.files[MODEL_FILE] = Served(data)
    if served is None:
        del server.files[PROJECTOR_NAME]
    else:
        server.files[PROJECTOR_NAME] = Served(served)
    settings = make_settings(tmp_path, server)
    with pytest.raises(error):
        pull_model("hf.co/TestOrg/Broken-GGUF:Q8_0", settings, retry=FAST_RETRY)
    assert ModelStore(settings).list() == []
    assert not (ModelStore(settings).model_dir("hf.co/TestOrg/Broken-GGUF", "Q8_0") / PROJECTOR_NAME).exists()


def test_a_language_model_published_as_projector_is_refused(tmp_path, server, smollm2_gguf):  # noqa: F811
    data = smollm2_gguf.read_bytes()
    fake = projector_bytes("llama")
    listing = [item for item in hub_listing(MODEL_FILE, data) if not item["path"].startswith("mmproj")]
    server.hub["TestOrg/Odd-GGUF"] = [*listing, lfs("mmproj-odd-f16.gguf", fake)]
    server.files[MODEL_FILE] = Served(data)
    server.files["mmproj-odd-f16.gguf"] = Served(fake)
    settings = make_settings(tmp_path, server)
    with pytest.raises(GGUFError, match="not a vision projector"):
        pull_model("hf.co/TestOrg/Odd-GGUF:Q8_0", settings, retry=FAST_RETRY)
    assert ModelStore(settings).list() == []


def test_the_catalog_names_the_projector_or_none(tmp_path, server, smollm2_gguf):  # noqa: F811
    data = smollm2_gguf.read_bytes()
    q8 = projector_bytes()
    server.hub["ggml-org/Vis-GGUF"] = hub_listing(MODEL_FILE, data, extra=[lfs("mmproj-model-Q8_0.gguf", q8)])
    server.files[MODEL_FILE] = Served(data)
    server.files["mmproj-model-Q8_0.gguf"] = Served(q8)
    source = [{"hf": "ggml-org/Vis-GGUF", "quant": "Q8_0"}]
    models = {"vis": {"variants": {"Q8_0": {"quant": "Q8_0", "sources": source, "mmproj": "mmproj-model-Q8_0.gguf"}}},
              "blind": {"variants": {"Q8_0": {"quant": "Q8_0", "sources": source, "mmproj": "none"}}}}
    settings = make_settings(tmp_path, server, models=models)
    assert pull_model("vis", settings, retry=FAST_RETRY).mmproj.name == "mmproj-model-Q8_0.gguf"
    assert pull_model("blind", settings, retry=FAST_RETRY).mmproj is None


def test_add_with_mmproj_registers_the_projector_in_place(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    projector = tmp_path / "mmproj-mine.gguf"
    projector.write_bytes(PROJECTOR)
    added = run_cli("add", str(smollm2_gguf), "--name", "seer", "--mmproj", str(projector), home=home)
    assert added.returncode == 0, added.stderr
    assert "vision projector" in added.stdout
    listed = run_cli("show", "seer", "--json", home=home)
    info = json.loads(listed.stdout)
    assert info["vision"] is True and info["mmproj"] == str(projector.resolve())
    manifest = json.loads((home / "models" / "seer" / "latest" / "manifest.json").read_text())
    assert manifest["mmproj"] == {"file": str(projector.resolve()), "in_place": True, "size": len(PROJECTOR),
                                  "sha256": hashlib.sha256(PROJECTOR).hexdigest()}
    # A language model given as the projector, or a missing file: refused, nothing registered.
    refused = run_cli("add", str(smollm2_gguf), "--name", "odd", "--mmproj", str(smollm2_gguf), home=home)
    assert refused.returncode != 0 and "not a vision projector" in refused.stderr
    missing = run_cli("add", str(smollm2_gguf), "--name", "gone", "--mmproj", str(tmp_path / "nope.gguf"), home=home)
    assert missing.returncode != 0 and "nope.gguf" in missing.stderr
    assert not (home / "models" / "odd").exists() and not (home / "models" / "gone").exists()
