"""`pull hf.co/ORG/REPO` of a repo holding an onnxruntime-genai folder, against a real local server
answering like the Hub (test_pull.LocalServer) that serves the real SmolLM2 OGA folder our
converter writes (test_oga's cached conversion, 540 MB of fp32 weights)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime_genai")

from localserve.errors import ChecksumMismatchError, ModelDirError, ModelNotFoundError, NetworkError  # noqa: E402
from localserve.config.settings import replace  # noqa: E402
from localserve.pull import pull_model  # noqa: E402
from localserve.pull.folder import STAGING_DIR  # noqa: E402
from localserve.pull.hf_folders import choose_folder  # noqa: E402
from localserve.pull.partials import sweep_stale_partials  # noqa: E402
from localserve.store.cache import ModelStore  # noqa: E402
from server_harness import LiveServer  # noqa: E402
from test_oga import converted_smollm2_oga  # noqa: E402
from test_pull import FAST_RETRY, LocalServer, Served, hub_listing, make_settings, run_cli  # noqa: E402
from worker_locks import THREADS

LFS = ("model.onnx", "model.onnx.data", "tokenizer.json")  # as a Hub repo's .gitattributes would put in LFS
REPO = "Vendor/SmolLM2-ONNX"


@pytest.fixture(scope="module")
def oga_files(smollm2_gguf) -> dict[str, bytes]:
    folder = converted_smollm2_oga(smollm2_gguf)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def server():
    srv = LocalServer().start()
    yield srv
    srv.stop()


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def item(path: str, data: bytes, lfs: bool) -> dict[str, Any]:
    """One entry of the Hub's tree listing: LFS files carry their sha256, git files their blob id."""
    if lfs:
        return {"type": "file", "oid": "0" * 40, "size": 134, "path": path,
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
    return {"type": "file", "oid": git_oid(data), "size": len(data), "path": path}


def publish(server: LocalServer, repo: str, folders: dict[str, dict[str, bytes]]) -> list[dict[str, Any]]:
    """Serve `folders` ({"": root files, "sub": files}) as `repo`, with a README and .gitattributes
    at the root like a real repo. LocalServer serves a file by its base name: same names hold the
    same bytes here."""
    extra = {".gitattributes": b"*.data filter=lfs\n", "README.md": b"# test\n"}
    listing = [item(name, data, False) for name, data in extra.items()]
    for prefix, files in folders.items():
        for name, data in files.items():
            listing.append(item(f"{prefix}/{name}" if prefix else name, data, name in LFS))
            server.files.setdefault(name, Served(data))
    server.files.setdefault("README.md", Served(extra["README.md"]))
    server.hub[repo] = listing
    return listing


def file_requests(server: LocalServer) -> list[str]:
    return [r["path"] for r in server.log if r["path"].startswith("/files/")]


def test_an_oga_repo_is_pulled_as_the_oga_variant_listed_and_served(tmp_path, server, oga_files):
    publish(server, REPO, {"cpu-fp32": oga_files})
    settings = make_settings(tmp_path, server)
    env = {"LOCALSERVE_HF_ENDPOINT": server.url}

    pulled = run_cli("pull", f"hf.co/{REPO}", home=settings.home, **env)

    assert pulled.returncode == 0, pulled.stderr
    assert f"hf.co/{REPO}:cpu-fp32 ready" in pulled.stdout
    assert "pulling cpu-fp32/model.onnx.data" in pulled.stderr  # one progress row per file
    (model,) = ModelStore(settings).list()
    assert (model.name, model.tag, list(model.variants)) == (f"hf.co/{REPO}", "cpu-fp32", ["oga"])
    oga = model.variants["oga"]
    assert {rel: e["sha256"] for rel, e in oga.files.items()} == {
        rel: hashlib.sha256(data).hexdigest() for rel, data in oga_files.items()}
    oga.verify(model.ref)
    assert model.manifest["variants"]["oga"]["source"]["folder"] == "cpu-fp32"
    assert sorted(p.name for p in model.path.parent.iterdir()) == sorted([oga.path.name, "manifest.json"])
    assert all(p.startswith(f"/{REPO}/resolve/main/cpu-fp32/") for p in
               (r["path"] for r in server.log if "/resolve/" in r["path"]))
    listed = run_cli("list", home=settings.home)
    (row,) = [line.split() for line in listed.stdout.splitlines() if line.strip().startswith("hf.co/")]
    assert row[:2] == [f"hf.co/{REPO}", "cpu-fp32"] and "oga" in row

    requested = len(file_requests(server))
    again = run_cli("pull", f"hf.co/{REPO}:CPU-FP32", home=settings.home, **env)
    assert again.returncode == 0 and "already up to date" in again.stderr
    assert len(file_requests(server)) == requested  # only the listing was asked again

    with LiveServer(replace(settings, threads=THREADS, context_length=1024)) as live:
        status, answer = live.json("POST", "/v1/chat/completions", {
            "model": f"hf.co/{REPO}", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, answer
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_an_interrupted_folder_pull_shows_nothing_and_resumes_where_it_stopped(tmp_path, server, oga_files):
    publish(server, REPO, {"cpu": oga_files, "npu": oga_files})
    server.files["model.onnx.data"] = Served(oga_files["model.onnx.data"], stall_after=40_000_000)
    settings = replace(make_settings(tmp_path, server), pull_stall_timeout=2.0)

    with pytest.raises(NetworkError, match="stalled"):
        pull_model(f"hf.co/{REPO}:NPU", settings, retry=FAST_RETRY)

    store = ModelStore(settings)
    assert store.list() == []
    staging = store.model_dir(f"hf.co/{REPO}", "npu") / STAGING_DIR
    kept = (staging / "model.onnx.data.partial").stat().st_size
    assert kept == 40_000_000 and sorted(p.name for p in staging.iterdir()) == [
        "genai_config.json", "model.onnx", "model.onnx.data.partial", "model.onnx.data.partial.json"]

    server.files["model.onnx.data"].stall_after = None
    model = pull_model(f"hf.co/{REPO}:npu", settings, retry=FAST_RETRY)

    last = server.requests_for("model.onnx.data")[-1]
    assert last["range"] == f"bytes={kept}-" and last["sent"] == len(oga_files["model.onnx.data"]) - kept
    for done in ("genai_config.json", "model.onnx"):  # verified again on disk, not fetched again
        assert len(server.requests_for(done)) == 1
    assert all("/resolve/main/npu/" in r["path"] for r in server.log if "/resolve/" in r["path"])
    assert (model.tag, list(model.variants)) == ("npu", ["oga"])
    model.variants["oga"].verify(model.ref)
    assert not staging.exists()


def test_a_file_with_wrong_bytes_fails_the_pull_and_nothing_is_installed(tmp_path, server, oga_files):
    publish(server, REPO, {"": oga_files})
    config = oga_files["genai_config.json"]
    server.files["genai_config.json"] = Served(config.replace(b'"llama"', b'"llamo"'))  # kept in git: a blob id
    settings = make_settings(tmp_path, server)

    with pytest.raises(ChecksumMismatchError, match="genai_config.json: git blob id mismatch"):
        pull_model(f"hf.co/{REPO}", settings, retry=FAST_RETRY)

    store = ModelStore(settings)
    assert store.list() == []
    directory = store.model_dir(f"hf.co/{REPO}", "oga")  # a root folder's tag
    # The bad file was removed; it was the first one fetched (the config comes first, so its options
    # are checked before any weights are downloaded).
    assert [p.name for p in (directory / STAGING_DIR).iterdir()] == []


def test_published_files_that_make_no_usable_folder_are_refused_and_removed(tmp_path, server, oga_files):
    graph_only = {name: oga_files[name] for name in ("genai_config.json", "model.onnx")}  # no weights, no tokenizer
    publish(server, REPO, {"cpu": graph_only})
    settings = make_settings(tmp_path, server)

    with pytest.raises(ModelDirError, match=f"hf.co/{REPO}:cpu is not a usable onnxruntime-genai folder: "
                                            "the folder has no model.onnx.data"):
        pull_model(f"hf.co/{REPO}", settings, retry=FAST_RETRY)

    store = ModelStore(settings)
    assert store.list() == []
    assert [p.name for p in store.model_dir(f"hf.co/{REPO}", "cpu").iterdir()] == []  # staging removed too


def test_an_abandoned_staging_folder_is_swept_by_its_newest_file(tmp_path):
    settings = make_settings(tmp_path)
    store = ModelStore(settings)
    old, recent = (store.model_dir("hf.co/V/R", tag) / STAGING_DIR for tag in ("old", "recent"))
    month_ago = time.time() - 30 * 86400
    for staging in (old, recent):
        (staging / "sub").mkdir(parents=True)
        (staging / "sub" / "model.onnx.data.partial").write_bytes(b"x" * 10)
        for path in (staging, staging / "sub", staging / "sub" / "model.onnx.data.partial"):
            os.utime(path, (month_ago, month_ago))
    os.utime(recent / "sub" / "model.onnx.data.partial")  # bytes appended today: the folders' times stay old

    removed = sweep_stale_partials(store.root, 7 * 86400)

    assert removed == [old] and not old.parent.exists()
    assert (recent / "sub" / "model.onnx.data.partial").is_file()


def test_a_repo_with_two_folders_needs_a_choice(tmp_path, server, oga_files):
    small = {name: data for name, data in oga_files.items() if name != "model.onnx.data"}
    publish(server, REPO, {"cpu": small, "npu": small})
    settings = make_settings(tmp_path, server)

    with pytest.raises(ModelNotFoundError, match="holds 2 onnxruntime-genai folders; name one") as info:
        pull_model(f"hf.co/{REPO}", settings, retry=FAST_RETRY)
    assert info.value.suggestions == [f"hf.co/{REPO}:cpu", f"hf.co/{REPO}:npu"]
    with pytest.raises(ModelNotFoundError, match="has no onnxruntime-genai folder 'GPU' \\(did you mean: hf.co/"):
        pull_model(f"hf.co/{REPO}:gpu", settings, retry=FAST_RETRY)
    assert file_requests(server) == [] and ModelStore(settings).list() == []
    assert not ModelStore(settings).model_dir(f"hf.co/{REPO}", "cpu").exists()


def test_over_the_api_a_missing_choice_is_an_error_in_its_format(tmp_path, server, oga_files):
    small = {name: data for name, data in oga_files.items() if name != "model.onnx.data"}
    publish(server, REPO, {"cpu": small, "npu": small})
    with LiveServer(replace(make_settings(tmp_path, server), threads=THREADS)) as live:
        status, body = live.json("POST", "/api/pull", {"model": f"hf.co/{REPO}", "stream": False})
    assert status == 404, body
    assert body["error"] == (f"hf.co/{REPO} holds 2 onnxruntime-genai folders; name one "
                             f"(did you mean: hf.co/{REPO}:cpu, hf.co/{REPO}:npu?)")


def test_a_repo_with_neither_gguf_nor_an_oga_folder_is_a_clear_error(tmp_path, server):
    server.hub["Vendor/Weights"] = [item("model.safetensors", b"x" * 100, True), item("config.json", b"{}", False),
                                    item("deep/er/genai_config.json", b"{}", False)]  # too deep to be a model
    settings = make_settings(tmp_path, server)
    result = run_cli("pull", "hf.co/Vendor/Weights", home=settings.home, LOCALSERVE_HF_ENDPOINT=server.url)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: hf.co/Vendor/Weights has neither GGUF files nor an onnxruntime-genai folder (genai_config.json)")


def test_which_folder_a_listing_gives():
    """hf_folders.choose_folder on listings alone: GGUF files win unless a folder is named, a root
    folder is named `oga`, and neither dot-files nor other folders' files belong to the root's."""
    root = {"genai_config.json": b"{}", "model.onnx": b"g", "tokenizer.json": b"t"}
    listing = [item(".gitattributes", b"a", False), *(item(n, d, n in LFS) for n, d in root.items()),
               item("int4/genai_config.json", b"{}", False), item("int4/sub/model.onnx", b"g", True)]

    with pytest.raises(ModelNotFoundError, match="2 onnxruntime-genai folders; name one \\(did you mean: hf.co/Vendor/SmolLM2-ONNX:oga, "):
        choose_folder(listing, None, REPO, "http://hub")
    top = choose_folder(listing, "OGA", REPO, "http://hub")
    assert top is not None and (top.path, top.tag) == ("", "oga")
    assert [rel for rel, _ in top.files] == ["genai_config.json", "model.onnx", "tokenizer.json"]
    int4 = choose_folder(listing, "INT4", REPO, "http://hub")
    assert int4 is not None and int4.tag == "int4"
    (config, config_remote), (graph, graph_remote) = int4.files
    assert (config, graph) == ("genai_config.json", "sub/model.onnx")
    assert graph_remote.url == f"http://hub/{REPO}/resolve/main/int4/sub/model.onnx"
    assert graph_remote.sha256 == hashlib.sha256(b"g").hexdigest() and graph_remote.git_oid is None
    assert config_remote.git_oid == git_oid(b"{}") and config_remote.sha256 is None

    with_gguf = listing + hub_listing("model-Q4_K_M.gguf", b"gguf")
    assert choose_folder(with_gguf, None, REPO, "http://hub") is None  # a GGUF repo behaves as before
    assert choose_folder(with_gguf, "Q4_1", REPO, "http://hub") is None
    assert choose_folder(with_gguf, "int4", REPO, "http://hub") == int4

    escape = [item("../genai_config.json", b"{}", False), item("../model.onnx", b"g", True)]
    with pytest.raises(ModelNotFoundError, match="neither GGUF files nor"):
        choose_folder(escape, None, REPO, "http://hub")


# --- hostile folders (issue 25): a pull never brings code in ------------------------------------------
ATTACKER = "ls3-attacker/npu-model"


def published_hostile(tmp_path: Path, server: LocalServer) -> Path:
    """The review's attack folder (test_folder_attacks.hostile_oga) on the fake Hub as ATTACKER:npu."""
    from test_folder_attacks import hostile_oga

    folder, marker = hostile_oga(tmp_path)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    publish(server, ATTACKER, {"npu": files})
    return marker


def test_a_folder_shipping_a_library_is_refused_at_pull_before_the_library_is_fetched(tmp_path, server):
    marker = published_hostile(tmp_path, server)
    settings = make_settings(tmp_path, server)
    with pytest.raises(ModelDirError, match=f"hf.co/{ATTACKER}:npu is not a usable onnxruntime-genai folder: "
                                            "libls3ops.so is a shared library or an executable"):
        pull_model(f"hf.co/{ATTACKER}:npu", settings, retry=FAST_RETRY)
    assert file_requests(server) == []  # refused by its listing: not one byte fetched
    assert ModelStore(settings).list() == [] and not marker.exists()


def test_a_library_by_another_name_is_refused_by_its_bytes(tmp_path, server):
    from test_folder_attacks import marker_library, oga_config

    marker = tmp_path / "marker"
    elf = marker_library(tmp_path / "build", marker).read_bytes()
    publish(server, ATTACKER, {"npu": {"genai_config.json": json.dumps(oga_config()).encode(),
                                       "model.onnx": b"\x08\x09", "tokenizer.json": b"{}", "weights.bin": elf}})
    settings = make_settings(tmp_path, server)
    with pytest.raises(ModelDirError, match="weights.bin is a shared library or an executable"):
        pull_model(f"hf.co/{ATTACKER}:npu", settings, retry=FAST_RETRY)
    store = ModelStore(settings)
    assert store.list() == [] and not (store.model_dir(f"hf.co/{ATTACKER}", "npu") / STAGING_DIR).exists()
    assert not marker.exists()


def test_over_the_api_a_config_naming_a_library_is_refused_before_the_weights(tmp_path, server):
    """POST /api/pull as the dashboard's Pull form sends it: the config's option is refused once the
    config is in, so the (here 64 KiB, in real folders multi-GB) weights are never fetched."""
    from test_folder_attacks import oga_config

    config = oga_config(custom_ops_library="/usr/lib/libls3ops.so")
    publish(server, ATTACKER, {"npu": {"genai_config.json": json.dumps(config).encode(), "model.onnx": b"\x08\x09",
                                       "model.onnx.data": bytes(65536), "tokenizer.json": b"{}"}})
    with LiveServer(replace(make_settings(tmp_path, server), threads=THREADS)) as live:
        status, body = live.json("POST", "/api/pull", {"model": f"hf.co/{ATTACKER}:npu", "stream": False})
        assert status == 400, body
        assert "custom_ops_library is not allowed" in body["error"] and str(tmp_path) not in body["error"]
        assert file_requests(server) == ["/files/genai_config.json"]
        status, body = live.json("POST", "/api/chat", {"model": f"hf.co/{ATTACKER}:npu", "stream": False,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert status == 404, body  # nothing was installed
