"""A tag with several variants (GGUF file, ONNX folder, onnxruntime-genai folder): manifests old and
new, folder checks and checksums, atomic adds, and the backend registry that chooses among them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from fixtures.hw.loader import fixture_env
from localserve.store import model_dirs
from localserve.runtime import manager as models
from localserve.runtime import planning
from localserve.runtime import registry
from localserve.config.settings import load_settings
from localserve.errors import BackendError, ConfigError, ModelDirError
from localserve.hardware import detect_hardware
from localserve.store.cache import ModelStore
from test_pull import run_cli

# A serialized ONNX ModelProto holding only ir_version = 9 (field 1, varint): the smallest real one.
MODEL_PROTO = b"\x08\x09"
# The CLI tests probe this machine: whether ONNX Runtime is installed decides what an ONNX-only
# model can run on (its CPU EP, or nothing).
HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None
GGUF_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # SmolLM2-135M Q4_1


def settings_for(tmp_path: Path, **env: str):
    return load_settings(flags={"home": str(tmp_path / "home")}, environ=env, config_path=tmp_path / "none.toml")


def onnx_folder(root: Path, **meta_changes: object) -> Path:
    folder = root / "smol-onnx"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(MODEL_PROTO)
    (folder / "model.onnx.data").write_bytes(bytes(range(256)) * 64)
    meta = {"localserve_onnx": 1, "architecture": "llama", "tokenizer": {"gguf_sha256": GGUF_SHA},
            "context_length": 8192, **meta_changes}
    (folder / "localserve-onnx.json").write_text(json.dumps(meta))
    return folder


def oga_folder(root: Path) -> Path:
    folder = root / "smol-oga"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "decoder.onnx").write_bytes(MODEL_PROTO)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "llama", "decoder": {"filename": "sub/decoder.onnx"}}}))
    return folder


def store_is_clean(store: ModelStore) -> bool:
    """No model visible, nothing left in staging, no variant folder anywhere."""
    tmp = store.root / ".tmp"
    return store.list() == [] and (not tmp.exists() or not any(tmp.iterdir())) and not any(
        p.is_dir() and p.name.startswith(("onnx-", "oga-")) for p in store.root.rglob("*"))


def test_a_schema_1_manifest_reads_as_one_gguf_variant(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    directory = store.model_dir("smollm2-135m", "Q4_1")
    directory.mkdir(parents=True)
    (directory / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    # Byte for byte what today's puller writes (facts trimmed).
    (directory / "manifest.json").write_text(json.dumps({
        "schema": 1, "name": "smollm2-135m", "tag": "Q4_1", "format": "gguf",
        "pulled_at": "2026-11-30T10:00:00Z", "pulled_at_epoch": 1796032800.0,
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "in_place": False, "size": 98362432, "sha256": GGUF_SHA,
        "quant": "Q4_1", "source": {"kind": "wheel", "ref": "smollm2-135m"}, "facts": {"architecture": "llama"},
        "license": "apache-2.0", "description": "SmolLM2"}))
    (model,) = store.list()
    assert list(model.variants) == ["gguf"]
    gguf = model.variants["gguf"]
    assert (gguf.path, gguf.size, gguf.sha256) == (directory / "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432, GGUF_SHA)
    assert (model.path, model.format, model.quant, model.facts) == (gguf.path, "gguf", "Q4_1", {"architecture": "llama"})
    assert model.available


def test_onnx_folder_joins_the_gguf_of_its_tag_with_per_file_checksums(tmp_path, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    store.register_local(smollm2_gguf, "smol", "q41")
    model = store.add_directory(onnx_folder(tmp_path), "smol", "q41")

    assert sorted(model.variants) == ["gguf", "onnx"]
    assert model.path == smollm2_gguf.resolve() and model.sha256 == GGUF_SHA  # the GGUF stays primary
    onnx = model.variants["onnx"]
    assert onnx.path.parent == store.model_dir("smol", "q41") and onnx.path.name == f"onnx-{onnx.sha256[:12]}"
    assert set(onnx.files) == {"model.onnx", "model.onnx.data", "localserve-onnx.json"}
    assert onnx.files["model.onnx.data"]["size"] == 16384
    assert onnx.sha256 == model_dirs.tree_digest(onnx.files) and onnx.meta["architecture"] == "llama"
    onnx.verify(model.ref)

    # A re-pull rewrites the GGUF entry; the folder variant must survive it.
    again = store.write_manifest("smol", "q41", {**{k: model.manifest[k] for k in ("file", "in_place", "size", "sha256")}})
    assert sorted(again.variants) == ["gguf", "onnx"] and again.variants["onnx"].sha256 == onnx.sha256

    (onnx.path / "model.onnx.data").write_bytes(bytes(16384))  # same size, other bytes
    with pytest.raises(ModelDirError, match=r"onnx variant of smol:q41 is corrupt: model\.onnx\.data has the wrong sha256"):
        onnx.verify(model.ref)
    (onnx.path / "model.onnx.data").unlink()
    (onnx.path / "extra.bin").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="model.onnx.data missing, extra.bin not in the manifest"):
        onnx.verify(model.ref)


def test_oga_folder_and_replacing_a_variant(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    first = store.add_directory(oga_folder(tmp_path / "a"), "npu-model")
    assert list(first.variants) == ["oga"] and first.format == "oga" and first.path.is_dir()
    assert set(first.variants["oga"].files) == {"genai_config.json", "tokenizer.json", "sub/decoder.onnx"}

    changed = oga_folder(tmp_path / "b")
    (changed / "tokenizer.json").write_text('{"version": "1.0"}')
    second = store.add_directory(changed, "npu-model")
    assert second.variants["oga"].sha256 != first.variants["oga"].sha256
    assert not first.variants["oga"].path.exists()  # the replaced folder is gone
    assert sorted(p.name for p in store.model_dir("npu-model", "latest").iterdir()) == sorted(
        ["manifest.json", second.variants["oga"].path.name])


def _break(folder: Path, how: str) -> None:
    if how == "no-meta":
        (folder / "localserve-onnx.json").unlink()
    elif how == "no-graph":
        (folder / "model.onnx").unlink()
    elif how == "graph-not-onnx":
        (folder / "model.onnx").write_bytes(b"<html>404</html>")
    elif how == "meta-not-json":
        (folder / "localserve-onnx.json").write_text("{broken")
    elif how == "meta-version":
        (folder / "localserve-onnx.json").write_text(json.dumps({"localserve_onnx": 7, "architecture": "llama"}))
    elif how == "tokenizer-missing":
        (folder / "localserve-onnx.json").write_text(json.dumps(
            {"localserve_onnx": 1, "architecture": "llama", "tokenizer": {"file": "tokenizer.json"}}))
    elif how == "tokenizer-outside":
        (folder / "localserve-onnx.json").write_text(json.dumps(
            {"localserve_onnx": 1, "architecture": "llama", "tokenizer": {"file": "../../etc/passwd"}}))
    elif how == "symlink":
        (folder / "weights.bin").symlink_to(folder.parent / "elsewhere.bin")
        (folder.parent / "elsewhere.bin").write_bytes(b"x")


@pytest.mark.parametrize(("how", "message"), [
    ("no-meta", "the folder has no localserve-onnx.json"),
    ("no-graph", "the folder has no model.onnx"),
    ("graph-not-onnx", "model.onnx is not an ONNX model"),
    ("meta-not-json", "localserve-onnx.json is not valid JSON"),
    ("meta-version", "'localserve_onnx' must be 1"),
    ("tokenizer-missing", "the folder has no tokenizer.json"),
    ("tokenizer-outside", "must name a file inside the folder"),
    ("symlink", "weights.bin is a symbolic link"),
])
def test_incomplete_or_corrupt_onnx_folders_are_refused_leaving_nothing(tmp_path, how, message):
    store = ModelStore(settings_for(tmp_path))
    folder = onnx_folder(tmp_path)
    _break(folder, how)
    with pytest.raises(ModelDirError, match=message) as refused:
        store.add_directory(folder, "smol")
    assert str(tmp_path) not in str(refused.value)  # no host paths in what a client may see
    assert store_is_clean(store)


def test_oga_folder_without_its_pieces_is_refused(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    folder = oga_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match="no tokenizer.json"):
        store.add_directory(folder, "npu")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "../x.onnx"}}}))
    with pytest.raises(ModelDirError, match="model.decoder.filename must name a file inside the folder"):
        store.add_directory(folder, "npu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelDirError, match="is not a model folder"):
        store.add_directory(empty, "npu")
    assert store_is_clean(store)


def test_an_add_interrupted_after_the_copy_leaves_nothing(tmp_path, monkeypatch, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    store.register_local(smollm2_gguf, "smol")

    def interrupted(files):
        raise KeyboardInterrupt  # Ctrl-C once every byte is copied, before the rename

    monkeypatch.setattr(model_dirs, "tree_digest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.add_directory(onnx_folder(tmp_path), "smol")
    (model,) = store.list()
    assert list(model.variants) == ["gguf"]
    assert not any((store.root / ".tmp").iterdir())
    assert [p.name for p in store.model_dir("smol", "latest").iterdir()] == ["manifest.json"]


def test_cli_add_list_show_rm_a_folder(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    added = run_cli("add", str(onnx_folder(tmp_path)), "--name", "smol-onnx", home=home)
    assert added.returncode == 0, added.stderr
    assert "added smol-onnx:latest: onnx variant (3 files" in added.stdout
    listed = json.loads(run_cli("list", "--json", home=home).stdout)
    assert [(m["model"], sorted(m["variants"])) for m in listed] == [("smol-onnx:latest", ["onnx"])]
    assert listed[0]["variants"]["onnx"]["files"] == 3
    assert "onnx" in run_cli("list", home=home).stdout

    shown = run_cli("show", "smol-onnx", "--json", home=home)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["architecture"] == "llama"
    text = run_cli("show", "smol-onnx", home=home)
    assert text.returncode == 0 and "variant onnx" in text.stdout
    if HAVE_ORT:  # ONNX Runtime's CPU EP, named, though the backend cannot load it yet
        assert (info["placement"]["backend"], info["placement"]["execution_provider"]) == ("onnx", "CPUExecutionProvider")
        assert "onnx on CPU (cpu) via CPUExecutionProvider" in text.stdout
    else:  # show says nothing can run it, and why, instead of failing
        assert info["placement"]["backend"] is None
        assert "no installed runtime can run this model" in info["placement"]["reason"]
        assert "nothing here" in text.stdout

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(MODEL_PROTO)
    refused = run_cli("add", str(broken), "--name", "broken", home=home)
    assert refused.returncode != 0 and refused.stderr.startswith("Error: the folder has no localserve-onnx.json")
    assert "Traceback" not in refused.stderr

    assert run_cli("rm", "smol-onnx", home=home).returncode == 0
    assert json.loads(run_cli("list", "--json", home=home).stdout) == []


# -- the registry: preference, choice over the formats a tag holds, loading ---------------------

def both_variants(tmp_path: Path, smollm2_gguf: Path, **env: str):
    settings = settings_for(tmp_path, **env)
    store = ModelStore(settings)
    store.register_local(smollm2_gguf, "smol")
    return settings, store.add_directory(onnx_folder(tmp_path), "smol")


def strix_halo_with_vitisai():
    return detect_hardware(fixture_env("linux_strix_halo", onnx=["VitisAIExecutionProvider", "CPUExecutionProvider"]))


def test_auto_prefers_the_npu_but_falls_back_when_onnxruntime_is_missing(tmp_path, smollm2_gguf, monkeypatch):
    settings, model = both_variants(tmp_path, smollm2_gguf)
    choice = registry.choose(model, settings, strix_halo_with_vitisai(), None)
    assert (choice.backend, choice.device) == ("onnx", "npu:0")
    absent = dataclasses.replace(registry.REGISTRY["onnx"], missing=lambda: "onnxruntime is not installed")
    monkeypatch.setitem(registry.REGISTRY, "onnx", absent)
    choice = registry.choose(model, settings, strix_halo_with_vitisai(), None)
    assert (choice.backend, choice.device) == ("llamacpp", "gpu:0")
    assert "onnx on AMD NPU via VitisAIExecutionProvider would be preferred, but onnxruntime is not installed" \
        in choice.reason


def test_explicit_onnx_is_obeyed_and_its_load_says_what_is_missing(tmp_path, smollm2_gguf, monkeypatch):
    settings, model = both_variants(tmp_path, smollm2_gguf, LOCALSERVE_BACKEND="onnx")
    monkeypatch.setattr(planning, "hardware_report", strix_halo_with_vitisai)  # where plan_model takes it
    plan = models.plan_model(model, settings)
    assert (plan.choice.backend, plan.choice.execution_provider) == ("onnx", "VitisAIExecutionProvider")
    assert "backend onnx requested by env LOCALSERVE_BACKEND" in plan.choice.reason
    with pytest.raises(BackendError, match="not an export of localserve convert"):
        models.load_engine(model, settings)  # the test folder holds no converted graph
    # A corrupt folder is reported as such before the backend question.
    (model.variants["onnx"].path / "model.onnx").write_bytes(b"\x08\x08")
    with pytest.raises(ModelDirError, match="model.onnx has the wrong sha256"):
        models.load_engine(model, settings)


def test_per_model_override_and_bad_preferences(tmp_path, smollm2_gguf):
    settings, model = both_variants(tmp_path, smollm2_gguf, LOCALSERVE_BACKEND="onnx",
                                    LOCALSERVE_MODEL_BACKENDS="other=onnx, smol=llamacpp")
    assert registry.preference(settings, "smol:latest") == ("llamacpp", "setting model_backends")
    choice = registry.choose(model, settings, strix_halo_with_vitisai(), None)
    assert choice.backend == "llamacpp" and "backend llamacpp requested by setting model_backends" in choice.reason
    tagged = settings_for(tmp_path, LOCALSERVE_MODEL_BACKENDS="smol=llamacpp,smol:latest=onnx")
    assert registry.preference(tagged, "smol:latest") == ("onnx", "setting model_backends")
    assert registry.preference(tagged, "smol:q8") == ("llamacpp", "setting model_backends")
    assert registry.preference(settings_for(tmp_path), "smol:latest") == ("auto", "")

    with pytest.raises(ConfigError, match="'model_backends': 'smol' is not NAME"):
        registry.preference(settings_for(tmp_path, LOCALSERVE_MODEL_BACKENDS="smol"), "smol:latest")
    with pytest.raises(ConfigError, match="setting 'backend': 'tpu' is not one of auto, llamacpp, onnx"):
        registry.preference(settings_for(tmp_path, LOCALSERVE_BACKEND="tpu"), "smol:latest")
    gguf_only = ModelStore(settings).register_local(smollm2_gguf, "plain")
    if HAVE_ORT:  # the onnx backend takes it after converting its GGUF (tests/model/test_convert_first_use.py)
        assert registry.choose(gguf_only, settings, strix_halo_with_vitisai(), None).convert
    with pytest.raises(BackendError, match="backend llamacpp was requested by setting model_backends, but the model "
                                           "has no variant it runs"):
        registry.choose(ModelStore(settings).add_directory(onnx_folder(tmp_path / "o"), "onnx-only"),
                        settings_for(tmp_path, LOCALSERVE_MODEL_BACKENDS="onnx-only=llamacpp"),
                        strix_halo_with_vitisai(), None)


def test_hw_lists_where_each_installed_model_runs(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    assert run_cli("add", str(smollm2_gguf), "--name", "smol", home=home).returncode == 0
    assert run_cli("add", str(onnx_folder(tmp_path)), "--name", "smol", home=home).returncode == 0
    report = json.loads(run_cli("hw", "--json", home=home).stdout)
    (row,) = report["models"]
    assert (row["model"], sorted(row["variants"]), row["backend"]) == ("smol:latest", ["gguf", "onnx"], "llamacpp")
    forced = json.loads(run_cli("hw", "--json", "--backend", "onnx", home=home).stdout)["models"][0]
    if HAVE_ORT:
        assert (forced["backend"], forced["execution_provider"]) == ("onnx", "CPUExecutionProvider")
        assert "backend onnx requested by flag --backend" in forced["reason"]
    else:  # the forced backend has nothing to run on, and the row says so
        assert forced["backend"] is None and "no installed runtime can run this model (onnx)" in forced["reason"]
