"""Model folders are data, never code (issue 25; review 3 A.1, A.9): hostile ONNX and
onnxruntime-genai folders against the real store, the real `localserve add`, and OGA itself.

The library is real: a shared object compiled here whose constructor writes a marker file, the
way the review's attack ran code in the daemon at first chat. The first test shows OGA does load
it from an unchecked folder (the marker appears in a child process); every other test shows the
folder is refused, with the field named and no host path, and the marker never appears. The
graphs are real ONNX ModelProtos whose external data, sparse tensors or EPContext caches name
files outside the folder. The pull side (a local fake Hub) is in test_pull_oga.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from localserve.errors import ModelDirError  # noqa: E402
from localserve.store.cache import ModelStore  # noqa: E402
from test_model_variants import GGUF_SHA, MODEL_PROTO, settings_for, store_is_clean  # noqa: E402
from test_pull import run_cli  # noqa: E402

LIB_SOURCE = r"""
#include <stdio.h>
__attribute__((constructor)) static void ran(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the folder's library ran", f); fclose(f); }
}
"""


def marker_library(build: Path, marker: Path) -> Path:
    """A real shared library whose constructor writes `marker` as soon as anything dlopens it."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build the hostile library")
    build.mkdir(parents=True, exist_ok=True)
    (build / "lib.c").write_text(LIB_SOURCE)
    lib = build / "libls3ops.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(build / "lib.c")],
                   check=True, capture_output=True, timeout=60)
    return lib


def oga_config(**session_options: object) -> dict:
    """A genai_config.json as our converter writes it (what OGA 0.18 parses), with extra session options."""
    return {"model": {"type": "llama", "context_length": 64, "vocab_size": 50, "bos_token_id": 1,
                      "eos_token_id": 2, "pad_token_id": 2,
                      "decoder": {"filename": "model.onnx", "head_size": 16, "hidden_size": 64,
                                  "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                  "session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                                      **session_options},
                                  "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                             "past_key_names": "past_key_values.%d.key",
                                             "past_value_names": "past_key_values.%d.value"},
                                  "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                              "present_value_names": "present.%d.value"}}},
            "search": {"max_length": 64}}


def oga_folder(root: Path, config: dict, files: dict[str, bytes] | None = None) -> Path:
    folder = root / "npu-model"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(MODEL_PROTO)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "genai_config.json").write_text(json.dumps(config))
    for name, data in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def hostile_oga(tmp_path: Path, lib_name: str = "libls3ops.so", **options: object) -> tuple[Path, Path]:
    """The review's attack: custom_ops_library naming a library shipped in the folder. (folder, marker)"""
    marker = tmp_path / "marker"
    lib = marker_library(tmp_path / "build", marker)
    config = oga_config(custom_ops_library=lib_name, **options)
    return oga_folder(tmp_path / "src", config, {lib_name: lib.read_bytes()}), marker


def assert_refused(store: ModelStore, folder: Path, message: str, tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=message) as refused:
        store.add_directory(folder, "npu")
    assert str(tmp_path) not in str(refused.value)  # no host path in what a client may see
    assert store_is_clean(store)


# --- code in the folder ---------------------------------------------------------------------------
def test_unchecked_oga_really_runs_the_folders_library(tmp_path):
    """The control: the threat is real. OGA itself, handed the folder unchecked (in a child process),
    dlopens the library and its constructor runs before OGA notices it registers no ops."""
    pytest.importorskip("onnxruntime_genai")
    folder, marker = hostile_oga(tmp_path)
    code = "import sys, onnxruntime_genai as og\ntry:\n    og.Model(og.Config(sys.argv[1]))\nexcept Exception as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)
    assert "RegisterCustomOps" in done.stdout, done.stdout + done.stderr
    assert marker.read_text() == "the folder's library ran"


def test_a_custom_ops_library_is_refused_at_add_and_never_loaded(tmp_path):
    folder, marker = hostile_oga(tmp_path)
    store = ModelStore(settings_for(tmp_path))
    assert_refused(store, folder, "libls3ops.so is a shared library or an executable", tmp_path)

    (folder / "libls3ops.so").unlink()  # the option alone, naming a library anywhere, is refused too
    assert_refused(store, folder, r"model\.decoder\.session_options\.custom_ops_library is not allowed", tmp_path)

    done = run_cli("add", str(folder), "--name", "npu", home=tmp_path / "home")
    assert done.returncode != 0 and "custom_ops_library is not allowed" in done.stderr, done.stderr
    assert str(tmp_path) not in done.stderr
    assert not marker.exists()


@pytest.mark.parametrize("name", ["weights.bin", "sub/libx.so.1", "ops.dll", "ops.dylib"])
def test_a_library_under_any_name_is_refused(tmp_path, name):
    marker = tmp_path / "marker"
    elf = marker_library(tmp_path / "build", marker).read_bytes()
    folder = oga_folder(tmp_path / "src", oga_config(), {name: elf})
    assert_refused(ModelStore(settings_for(tmp_path)), folder, "is a shared library or an executable", tmp_path)
    assert not marker.exists()


def test_pe_mach_o_and_scripts_are_refused_and_look_alike_weights_are_not(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    pe = bytearray(b"MZ" + bytes(0x3E) + b"PE\0\0" + bytes(64))
    pe[0x3C:0x40] = (0x40).to_bytes(4, "little")  # e_lfanew -> "PE\0\0"
    for i, data in enumerate([bytes(pe), b"\xcf\xfa\xed\xfe" + bytes(60), b"#!/bin/sh\necho hi\n"]):
        folder = oga_folder(tmp_path / f"src{i}", oga_config(), {"blob.bin": data})
        assert_refused(store, folder, "blob.bin is a shared library or an executable", tmp_path)
    # Weights whose first bytes happen to be "MZ" are data: only a real PE header makes a program.
    folder = oga_folder(tmp_path / "ok", oga_config(), {"weights.bin": b"MZ" + bytes(200)})
    assert "oga" in store.add_directory(folder, "npu").variants


def test_build_oga_engine_refuses_a_hostile_folder_before_oga_sees_it(tmp_path):
    """Again at load: a folder stored before these checks (or changed since) never reaches og.Config.
    In-process, so a failed check would run the constructor here and the marker would show it."""
    pytest.importorskip("onnxruntime_genai")
    from localserve.runtime.oga_loader import build_oga_engine

    folder, marker = hostile_oga(tmp_path)
    with pytest.raises(ModelDirError, match="is a shared library or an executable"):
        build_oga_engine(folder)
    (folder / "libls3ops.so").unlink()  # the option alone, naming the library where it was built
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = str(tmp_path / "build" / "libls3ops.so")
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="custom_ops_library is not allowed"):
        build_oga_engine(folder)
    assert not marker.exists()


# --- session options: an allow-list -----------------------------------------------------------------
@pytest.mark.parametrize("options, field", [
    ({"enable_profiling": "prof_"}, "session_options.enable_profiling is not allowed"),
    ({"ep_context_file_path": "ctx.onnx"}, "session_options.ep_context_file_path is not allowed"),
    ({"ep.context_enable": "1"}, "session_options.ep.context_enable is not allowed"),  # an ORT config entry
    ({"config_entries": {"session.load_model_format": "ORT"}}, "session_options.config_entries is not allowed"),
    ({"provider_options": [{"qnn": {"backend_path": "libQnnHtp.so"}}]}, r"provider_options\[0\]\.qnn\.backend_path"),
    ({"provider_options": [{"QNN": {"htp_performance_mode": "../x"}}]}, "must be a plain value, not a path"),
    ({"provider_options": [{"VitisAI": {"config_file": "vaip_config.json"}}]}, "VitisAI.config_file is not allowed"),
    ({"provider_options": [{"MyPluginEP": {}}]}, "MyPluginEP is not an execution provider localserve knows"),
    ({"intra_op_num_threads": "4"}, "intra_op_num_threads has the wrong type"),
])
def test_session_options_outside_the_allow_list_are_refused_naming_the_field(tmp_path, options, field):
    folder = oga_folder(tmp_path / "src", oga_config(**options))
    assert_refused(ModelStore(settings_for(tmp_path)), folder, field, tmp_path)


def test_run_options_and_other_sections_are_checked_too(tmp_path):
    config = oga_config()
    config["model"]["decoder"]["run_options"] = {"qnn.lora_config": "adapter.bin"}
    assert_refused(ModelStore(settings_for(tmp_path)), oga_folder(tmp_path / "a", config), "run_options.qnn.lora_config", tmp_path)
    config = oga_config()
    config["model"]["embedding"] = {"filename": "model.onnx", "session_options": {"custom_ops_library": "x"}}
    assert_refused(ModelStore(settings_for(tmp_path)), oga_folder(tmp_path / "b", config),
                   "model.embedding.session_options.custom_ops_library", tmp_path)


def test_threads_the_ep_and_its_plain_flags_are_kept(tmp_path):
    config = oga_config(intra_op_num_threads=4, graph_optimization_level="ORT_ENABLE_ALL", enable_cpu_mem_arena=True,
                        provider_options=[{"QNN": {"htp_performance_mode": "burst", "soc_model": "60",
                                                   "device_filtering_options": {"hardware_device_type": "npu"}}}])
    model = ModelStore(settings_for(tmp_path)).add_directory(oga_folder(tmp_path / "src", config), "npu")
    stored = json.loads((model.variants["oga"].path / "genai_config.json").read_text())
    assert stored == config  # nothing rewritten: an allowed config is what the vendor shipped


# --- names that leave the folder ----------------------------------------------------------------
def tensor(location: str, name: str = "w") -> TensorProto:
    t = helper.make_tensor(name, TensorProto.FLOAT, [4], np.zeros(4, np.float32).tobytes(), raw=True)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def graph_bytes(location: str | None = None, *, sparse: str | None = None, ep_cache: str | None = None,
                embedded_mib: int = 0) -> bytes:
    """A real ModelProto: Identity over an external tensor at `location`, a sparse initializer whose
    values are external at `sparse`, an EPContext node whose cache file is `ep_cache`, and
    `embedded_mib` MiB of weights inside the graph (a large graph, not one with few files)."""
    initializers = [tensor(location)] if location else []
    if embedded_mib:
        initializers.append(helper.make_tensor("big", TensorProto.UINT8, [embedded_mib << 20],
                                               bytes(embedded_mib << 20), raw=True))
    nodes = [helper.make_node("Identity", ["w"], ["y"])] if location else []
    if ep_cache:
        nodes.append(helper.make_node("EPContext", [], ["y"], domain="com.microsoft", embed_mode=0,
                                      ep_cache_context=ep_cache))
    sparse_init = []
    if sparse:
        indices = helper.make_tensor("si", TensorProto.INT64, [1], [0])
        sparse_init.append(helper.make_sparse_tensor(tensor(sparse, "sv"), indices, [4]))
        sparse_init[0].values.dims[:] = [1]
        sparse_init[0].values.external_data[2].value = "4"
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              initializer=initializers, sparse_initializer=sparse_init)
    return helper.make_model(graph).SerializeToString()


def onnx_kind(root: Path, graph: bytes) -> Path:
    folder = root / "smol-onnx"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(graph)
    (folder / "model.onnx.data").write_bytes(bytes(64))
    (folder / "localserve-onnx.json").write_text(json.dumps(
        {"localserve_onnx": 1, "architecture": "llama", "tokenizer": {"gguf_sha256": GGUF_SHA}}))
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file beside the folders that a hostile name points at: it exists, so only its place refuses it."""
    (tmp_path / "outside.bin").write_bytes(bytes(64))
    (tmp_path / "outside.onnx").write_bytes(MODEL_PROTO)
    return tmp_path / "outside.bin"


@pytest.mark.parametrize("where", ["relative", "absolute", "sparse", "ep_context"])
def test_an_onnx_graph_naming_a_file_outside_is_refused_at_add(tmp_path, outside, where):
    graph = graph_bytes(**{"relative": {"location": "../outside.bin"}, "absolute": {"location": str(outside)},
                           "sparse": {"sparse": "../outside.bin"}, "ep_context": {"ep_cache": "../outside.bin"}}[where])
    assert_refused(ModelStore(settings_for(tmp_path)), onnx_kind(tmp_path / "src", graph),
                   "must name a file inside the folder", tmp_path)


def test_the_same_graphs_pointing_inside_are_accepted(tmp_path):
    store = ModelStore(settings_for(tmp_path))
    graph = graph_bytes("model.onnx.data", sparse="model.onnx.data", ep_cache="model.onnx.data")
    assert "onnx" in store.add_directory(onnx_kind(tmp_path / "src", graph), "smol").variants


def test_a_large_graph_gets_the_same_check(tmp_path, outside):
    """The old cutoff skipped graphs over 64 MiB, on the premise that those embed their weights."""
    graph = graph_bytes("../outside.bin", embedded_mib=65)
    folder = oga_folder(tmp_path / "src", oga_config(), {"model.onnx": graph})
    assert_refused(ModelStore(settings_for(tmp_path)), folder, "model.onnx's external data must name a file inside", tmp_path)


@pytest.mark.parametrize("section, key, value", [
    ("embedding", "filename", "../outside.onnx"),
    ("embedding", "filename", "/etc/hostname"),
    ("vision", "config_filename", "../outside.bin"),
    ("speech", "filename", "..\\outside.onnx"),
])
def test_an_oga_config_naming_a_file_outside_is_refused(tmp_path, outside, section, key, value):
    config = oga_config()
    config["model"][section] = {key: value}
    folder = oga_folder(tmp_path / "src", config)
    assert_refused(ModelStore(settings_for(tmp_path)), folder,
                   rf"model\.{section}\.{key} must name a file inside the folder", tmp_path)


def test_a_graph_inside_a_linked_folder_is_refused(tmp_path, outside):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "decoder.onnx").write_bytes(MODEL_PROTO)
    config = oga_config()
    config["model"]["decoder"]["filename"] = "sub/decoder.onnx"
    folder = oga_folder(tmp_path / "src", config)
    (folder / "sub").symlink_to(elsewhere, target_is_directory=True)
    assert_refused(ModelStore(settings_for(tmp_path)), folder, "sub is a symbolic link", tmp_path)


def test_oga_load_errors_name_no_host_path(tmp_path):
    from localserve.runtime.oga_loader import _scrub

    folder = tmp_path / "models" / "npu" / "oga-0123"
    error = RuntimeError(f"External data path: ../x.bin escapes model directory: {folder}; "
                         f"opened {tmp_path / 'models' / 'npu' / 'x.bin'}")
    text = _scrub(error, folder)
    assert str(tmp_path) not in text and "<folder>" in text and "x.bin" in text, text
