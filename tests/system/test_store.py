"""The model store: the name validator, manifests, in-place registration (`add`), list/find/rm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from localserve.config.settings import load_settings
from localserve.errors import GGUFError, InvalidNameError, ModelNotFoundError
from localserve.store.cache import FileLock, ModelStore, name_to_dir, safe_component
from test_pull import run_cli  # one CLI runner for the model-command tests

TRAVERSAL_AND_BAD_NAMES = [
    "", ".", "..", "../x", "../../etc/passwd", "a/b", "a\\b", "..\\..\\windows", "/etc/passwd", "/",
    "C:", "c:\\x", "x\x00y", "x\ny", "tab\there", "\x1b[31mred", "x\u202eevil", "a" * 200, ".hidden",
    "con", "NUL.gguf", "lpt1", "trailing.", "trailing ", " leading", "a:b", "what?", "pipe|name", "<x>",
]


@pytest.mark.parametrize("bad", TRAVERSAL_AND_BAD_NAMES)
def test_safe_component_rejects_traversal_and_unsafe_names(bad):
    with pytest.raises(InvalidNameError) as info:
        safe_component(bad)
    assert "\n" not in str(info.value) and "\x00" not in str(info.value)


@pytest.mark.parametrize("good", ["smollm2-135m", "Q4_K_M", "qwen2.5-coder-1.5b", "latest", "Llama-3.2-1B", "ünïcödé", "a..b"])
def test_safe_component_accepts_ordinary_names(good):
    assert safe_component(good) == good


def settings_for(tmp_path: Path):
    return load_settings(flags={"home": str(tmp_path / "home")}, environ={}, config_path=tmp_path / "none.toml")


def test_every_path_from_a_name_is_validated(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    assert name_to_dir("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF") == "hf.co--bartowski--Llama-3.2-1B-Instruct-GGUF"
    for name, tag in [("../evil", "latest"), ("hf.co/../../x", "Q4"), ("ok", "../../x"), ("ok", "/abs"), ("/abs", "t")]:
        with pytest.raises(InvalidNameError):
            store.model_dir(name, tag)
        with pytest.raises(InvalidNameError):
            store.lock(name, tag)
    with pytest.raises(InvalidNameError):
        store.register_local(tmp_path / "x.gguf", "../../outside", "latest")
    assert not (tmp_path / "outside").exists()


def test_add_registers_in_place_without_copying(tmp_path, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    model = store.register_local(smollm2_gguf, "mine", "v1")

    assert model.path == smollm2_gguf.resolve() and model.in_place
    assert model.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert (model.quant, model.size) == ("Q4_1", 98362432)
    assert model.facts["architecture"] == "llama" and model.facts["context_length"] == 8192
    assert list(store.root.rglob("*.gguf")) == []  # nothing copied into the cache
    assert [m.ref for m in store.list()] == ["mine:v1"]
    assert store.find("mine").path == model.path and store.find("MINE:V1").path == model.path
    assert store.find("mine:latest").path == model.path  # Ollama clients add `:latest`

    store.remove("mine:v1")
    assert store.list() == [] and smollm2_gguf.exists()  # the user's file is never deleted


def test_add_validates_the_file_first(tmp_path, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(1_000_000))
    for path in (garbage, truncated):
        with pytest.raises(GGUFError):
            store.register_local(path, "bad")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        store.register_local(tmp_path / "absent.gguf", "bad")
    assert store.list() == []


def test_find_suggests_and_disambiguates(tmp_path, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    store.register_local(smollm2_gguf, "smol", "a")
    store.register_local(smollm2_gguf, "smol", "b")
    with pytest.raises(ModelNotFoundError, match="several tags") as info:
        store.find("smol")
    assert info.value.suggestions == ["smol:a", "smol:b"]
    with pytest.raises(ModelNotFoundError, match="not installed") as info:
        store.find("smoll:a")
    assert "smol:a" in info.value.suggestions
    with pytest.raises(ModelNotFoundError):
        store.find("smol:c")


def test_a_damaged_manifest_hides_only_its_own_model(tmp_path, smollm2_gguf):
    store = ModelStore(settings_for(tmp_path))
    store.register_local(smollm2_gguf, "good")
    broken = store.model_dir("broken", "latest")
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")
    escape = store.model_dir("escape", "latest")
    escape.mkdir(parents=True)
    (escape / "manifest.json").write_text(json.dumps({"name": "escape", "tag": "latest", "file": "../../../etc/passwd"}))
    assert [m.ref for m in store.list()] == ["good:latest"]
    assert not list(store.root.rglob(".*.tmp"))  # atomic writes leave no temporary files


def test_file_lock_is_exclusive_between_holders(tmp_path):
    first, second = FileLock(tmp_path / "x.lock"), FileLock(tmp_path / "x.lock")
    assert first.acquire(blocking=False)
    assert not second.acquire(blocking=False)
    assert not second.acquire(timeout=0.1, poll=0.02)
    first.release()
    assert second.acquire(blocking=False)
    second.release()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors through /proc")
def test_file_lock_closes_its_descriptor_when_locking_fails(tmp_path, monkeypatch):
    import localserve.store.cache as store_module

    def broken(fd: int) -> bool:
        raise OSError("no locks on this filesystem")

    monkeypatch.setattr(store_module, "_try_lock", broken)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(OSError):
            FileLock(tmp_path / "x.lock").acquire()
    assert len(os.listdir("/proc/self/fd")) == before


def test_cli_add_list_rm(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    result = run_cli("add", str(bad), "--name", "bad", home=home)
    assert result.returncode != 0 and "Traceback" not in result.stderr and result.stderr.startswith("Error:")

    result = run_cli("add", str(smollm2_gguf), "--name", "local-smol:q41", home=home)
    assert result.returncode == 0, result.stderr
    listed = run_cli("list", "--json", home=home)
    assert [(m["model"], m["quant"], m["in_place"]) for m in json.loads(listed.stdout)] == [("local-smol:q41", "Q4_1", True)]
    table = run_cli("list", home=home)
    assert "local-smol" in table.stdout and "98.4 MB" in table.stdout and "Q4_1" in table.stdout

    traversal = run_cli("add", str(smollm2_gguf), "--name", "../../etc", home=home)
    assert traversal.returncode == 2 and "Traceback" not in traversal.stderr

    removed = run_cli("rm", "local-smol:q41", home=home)
    assert removed.returncode == 0 and "left in place" in removed.stdout
    assert json.loads(run_cli("list", "--json", home=home).stdout) == [] and smollm2_gguf.exists()


def test_cli_show_reports_facts_memory_and_placement(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    assert run_cli("add", str(smollm2_gguf), "--name", "smol", home=home).returncode == 0
    shown = run_cli("show", "smol", "--ctx", "2048", "--json", home=home)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert (info["architecture"], info["context_length"], info["quantization"]) == ("llama", 8192, "Q4_1")
    assert 130_000_000 < info["parameters"] < 140_000_000 and info["chat_template"] is True
    assert info["path"] == str(smollm2_gguf.resolve())
    memory = info["memory"]
    assert memory["n_ctx"] == 2048 and memory["total_bytes"] > memory["weights_bytes"] + memory["kv_bytes"]
    assert info["placement"]["backend"] in ("llamacpp", "onnx") and info["placement"]["reason"]
    # CI's CPU build: nothing planned on a GPU (SmolLM2: 30 layers + the output layer).
    assert info["gpu"] == {"layers": 0, "of_layers": 31, "memory_bytes": 0, "cpu_moe_layers": 0, "experts_ram_bytes": 0}
    assert memory["expert_bytes"] == 0  # a dense model: no MoE experts to keep in RAM

    text = run_cli("show", "smol", home=home)
    assert text.returncode == 0 and "llama" in text.stdout and "8192" in text.stdout and "Q4_1" in text.stdout
    assert "memory as loaded" in text.stdout
    # The context per request and the concurrency a load here gets (batching/limits.py).
    engine = json.loads(run_cli("show", "smol", "--json", home=home).stdout)["engine"]
    assert engine["context_per_request"] == 8192 and engine["concurrent_requests"] >= 4
    assert engine["kv_layout"] in ("streams", "unified") and engine["kv_cells"] >= 8192
    assert f"8192 tokens per request, {engine['concurrent_requests']} at once" in text.stdout
    missing = run_cli("show", "smoll", home=home)
    assert missing.returncode == 1 and missing.stderr.startswith("Error: model 'smoll' is not installed")
