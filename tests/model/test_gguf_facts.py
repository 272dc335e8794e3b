"""GGUF facts: the real SmolLM2 file, files written by the `gguf` package, and hostile headers."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localserve.errors import GGUFError
from localserve.store.gguf_facts import ArrayInfo, GGUFFacts, read_gguf_facts, read_gguf_metadata

N_VOCAB = 5000  # > KEEP_ARRAY_LEN, so the token list takes the skip path


def write_tiny_llama(path: Path, *, endian: GGUFEndian = GGUFEndian.LITTLE, file_type: int | None = 1,
                     kv_heads: int | list[int] = 2, dtype: type = np.float16, split_max_tensors: int = 0) -> Path:
    """A structurally complete 2-layer llama GGUF written by the gguf package's own writer."""
    w = GGUFWriter(str(path), "llama", endianess=endian, split_max_tensors=split_max_tensors)
    w.add_name("tiny-llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(kv_heads)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_license("mit")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((N_VOCAB, 64), dtype))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((64, 64), dtype))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.zeros((32, 64), dtype))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros(64, np.float32))
    w.add_tensor("output_norm.weight", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- a raw writer for headers the real writer refuses to produce -------------------------------

def _s(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def raw_gguf(kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0,
             version: int = 3, data: bytes = b"", arch: bool = True) -> bytes:
    if arch:
        kvs = _s("general.architecture") + struct.pack("<I", 8) + _s("llama") + kvs
        n_kv += 1
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + tensors
    pad = -len(head) % 32
    return head + b"\0" * pad + data


def tensor_info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type, offset)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf")


def expect_error(tmp_path: Path, blob: bytes, match: str) -> GGUFError:
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(GGUFError, match=match) as e:
        read_gguf_facts(p)
    assert str(tmp_path) not in str(e.value)  # names the file, never the host path around it
    return e.value


# --- real files -------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm2_facts(smollm2_gguf: Path) -> None:
    f = read_gguf_facts(smollm2_gguf)
    assert (f.architecture, f.quant, f.file_type, f.context_length) == ("llama", "Q4_1", "Q4_1", 8192)
    assert f.n_params == 134_515_008  # sum of tensor elements, same as gguf.GGUFReader's
    assert (f.n_layers, f.n_heads, f.n_kv_heads, f.n_embd, f.head_dim) == (30, 9, 3, 576, 64)
    assert (f.tokenizer_model, f.vocab_size, f.bos_token_id, f.eos_token_id) == ("gpt2", 49152, 1, 2)
    assert f.chat_template and "<|im_start|>" in f.chat_template
    assert f.license == "apache-2.0"
    assert f.file_size == 98_362_432 and f.tensor_count == 272
    assert f.weights_bytes == 96_576_768  # llama.cpp: "CPU_Mapped model buffer size = 92.10 MiB"
    assert f.layer_bytes == 30 * f.largest_layer_bytes  # all blocks the same size
    assert GGUFFacts.from_dict(json.loads(json.dumps(f.as_dict()))) == f


def test_reads_what_the_gguf_writer_writes(tiny: Path) -> None:
    f = read_gguf_facts(tiny)
    assert f.architecture == "llama" and f.name == "tiny-llama"
    assert (f.n_layers, f.n_heads, f.n_kv_heads, f.n_embd, f.head_dim, f.context_length) == (2, 4, 2, 64, 16, 256)
    assert f.n_params == N_VOCAB * 64 + 2 * (64 * 64 + 32 * 64 + 64) + 64
    assert f.quant == "F16" and f.file_type_id == 1
    assert f.vocab_size == N_VOCAB and f.tokenizer_model == "gpt2" and f.license == "mit"
    assert f.weights_bytes == (N_VOCAB * 64 + 2 * (64 * 64 + 32 * 64)) * 2 + 3 * 64 * 4
    assert f.largest_layer_bytes == (64 * 64 + 32 * 64) * 2 + 64 * 4
    assert f.kv_heads_all_layers == 4
    meta = read_gguf_metadata(tiny)
    assert meta["tokenizer.ggml.tokens"] == ArrayInfo(8, N_VOCAB)  # skipped, not held in memory


def test_big_endian_file(tmp_path: Path, tiny: Path) -> None:
    big = read_gguf_facts(write_tiny_llama(tmp_path / "big.gguf", endian=GGUFEndian.BIG))
    little = read_gguf_facts(tiny)
    assert big == little


def test_quant_from_dominant_tensor_type_without_file_type(tmp_path: Path) -> None:
    assert read_gguf_facts(write_tiny_llama(tmp_path / "a.gguf", file_type=None)).quant == "F16"


@pytest.mark.parametrize(("file_type", "name"), [(15, "Q4_K_M"), (0, "F32"), (1024 | 7, "Q8_0"), (30, "IQ4_XS")])
def test_quant_names_from_llama_ftype(tmp_path: Path, file_type: int, name: str) -> None:
    blob = raw_gguf(_s("general.file_type") + struct.pack("<II", 4, file_type), 1)
    (tmp_path / "m.gguf").write_bytes(blob)
    assert read_gguf_facts(tmp_path / "m.gguf").quant == name


def test_per_layer_kv_heads_of_hybrid_models(tmp_path: Path) -> None:
    # Hybrid attention/SSM models (Jamba, Granite-H) give one KV head count per layer, 0 on SSM layers.
    f = read_gguf_facts(write_tiny_llama(tmp_path / "h.gguf", kv_heads=[2, 0]))
    assert (f.n_kv_heads, f.kv_heads_all_layers) == (2, 2)


def test_split_model_is_read_through_its_first_part(tmp_path: Path, tiny: Path) -> None:
    (tmp_path / "split").mkdir()
    write_tiny_llama(tmp_path / "split" / "tiny.gguf", split_max_tensors=3)
    parts = sorted((tmp_path / "split").iterdir())
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, split = read_gguf_facts(tiny), read_gguf_facts(parts[0])
    assert split.file_size == sum(p.stat().st_size for p in parts)
    assert dataclasses.replace(split, file_size=whole.file_size) == whole
    with pytest.raises(GGUFError, match="part 2 of 3 of a split model; use the first part"):
        read_gguf_facts(parts[1])
    parts[2].unlink()
    with pytest.raises(GGUFError, match=r"part 3 of 3 \(tiny-00003-of-00003.gguf\) is missing"):
        read_gguf_facts(parts[0])
    renamed = parts[0].rename(tmp_path / "split" / "renamed.gguf")
    with pytest.raises(GGUFError, match="does not follow NAME-00001-of-00003.gguf"):
        read_gguf_facts(renamed)


# --- hostile and broken files ---------------------------------------------------------------

def test_garbage_and_empty_files(tmp_path: Path) -> None:
    expect_error(tmp_path, np.random.default_rng(0).bytes(4096), "not a GGUF file")
    expect_error(tmp_path, b"", "not a GGUF file")
    expect_error(tmp_path, b"GGUF", "truncated")


def test_every_truncation_is_a_clean_error(tiny: Path, tmp_path: Path) -> None:
    blob = tiny.read_bytes()
    cuts = sorted(set(range(0, 300)) | set(range(0, len(blob), max(1, len(blob) // 60))) | {len(blob) - 1})
    for cut in cuts:
        expect_error(tmp_path, blob[:cut], "truncated|not a GGUF")


def test_forged_lengths_do_not_allocate(tmp_path: Path) -> None:
    huge = 1 << 62
    expect_error(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"k", huge), "limit .*corrupt")
    expect_error(tmp_path, raw_gguf(_s("k") + struct.pack("<I", 8) + _s(b"v", 1 << 40), 1), "limit .*corrupt")
    array = _s("a") + struct.pack("<IIQ", 9, 0, huge)
    expect_error(tmp_path, raw_gguf(array, 1), "more than the file can hold")
    array_of_strings = _s("a") + struct.pack("<IIQ", 9, 8, 10_000_000)
    expect_error(tmp_path, raw_gguf(array_of_strings, 1), "more than the file can hold")
    expect_error(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, huge, 0), "tensors, more than the file can hold")
    expect_error(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, 0, huge), "metadata entries")


def test_value_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Millions of empty strings are cheap to forge but slow to walk: the header's value budget stops
    # them (at 16M values; lowered here so the test file stays small).
    monkeypatch.setattr("localserve.store.gguf_facts.MAX_ITEMS", 1000)
    many = _s("a") + struct.pack("<IIQ", 9, 8, 1001) + b"\0" * 8 * 1001
    expect_error(tmp_path, raw_gguf(many, 1), "more than 1000 values")


def _nested_byte_arrays(outer: int, inner: int) -> bytes:
    """One key holding `outer` arrays of `inner` uint8 each: one byte of file per kept item."""
    one = struct.pack("<IQ", 0, inner) + b"\x07" * inner
    return _s("n") + struct.pack("<IIQ", 9, 9, outer) + one * outer


def test_nested_byte_arrays_hold_less_than_the_file(tmp_path: Path) -> None:
    # 2048 x 2048 bytes: every array is short enough to keep, which used to mean 4M list slots
    # (~8x the file). The kept total now stops at MAX_KEPT_ITEMS; later arrays keep their length.
    path = tmp_path / "nested.gguf"
    path.write_bytes(raw_gguf(_nested_byte_arrays(2048, 2048), 1))
    tracemalloc.start()
    try:
        meta = read_gguf_metadata(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size
    arrays = meta["n"]
    assert len(arrays) == 2048
    assert arrays[0] == [7] * 2048
    assert arrays[-1] == ArrayInfo(0, 2048)
    assert sum(isinstance(a, list) for a in arrays) == (1 << 18) // 2048 - 1  # the outer list's 2048 count too


def test_nested_array_claiming_more_than_the_file_is_refused(tmp_path: Path) -> None:
    # An inner array's length is checked against the bytes left, not just the outer one's.
    forged = _s("n") + struct.pack("<IIQ", 9, 9, 2) + struct.pack("<IQ", 0, 1 << 40)
    start = time.monotonic()
    expect_error(tmp_path, raw_gguf(forged, 1), "more than the file can hold")
    assert time.monotonic() - start < 5  # liveness: refused at once, without allocating or looping


def test_tensor_extents_are_checked(tmp_path: Path) -> None:
    f32 = 0
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("w", [64], f32), n_tensors=1, data=b"\0" * 100),
                 "tensor 'w' ends at byte")
    ok = raw_gguf(tensors=tensor_info("w", [64], f32), n_tensors=1, data=b"\0" * 256)
    (tmp_path / "ok.gguf").write_bytes(ok)
    assert read_gguf_facts(tmp_path / "ok.gguf").n_params == 64
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("w", [64], f32, offset=1 << 50), n_tensors=1, data=b"\0" * 256),
                 "ends at byte")
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("w", [4], f32, offset=8), n_tensors=1, data=b"\0" * 64), "not aligned")
    two = tensor_info("a", [16], f32) + tensor_info("b", [16], f32, offset=32)
    expect_error(tmp_path, raw_gguf(tensors=two, n_tensors=2, data=b"\0" * 128), "overlaps")
    dup = tensor_info("a", [8], f32) + tensor_info("a", [8], f32, offset=32)
    expect_error(tmp_path, raw_gguf(tensors=dup, n_tensors=2, data=b"\0" * 128), "appears twice")
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("w", [4], 77), n_tensors=1, data=b"\0" * 64), "unknown type 77")
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("w", [1, 1, 1, 1, 1]), n_tensors=1), "5 dimensions")
    expect_error(tmp_path, raw_gguf(tensors=tensor_info("q", [33], 2), n_tensors=1, data=b"\0" * 64), "block size 32")


def test_other_header_errors(tmp_path: Path) -> None:
    expect_error(tmp_path, raw_gguf(version=1), "unsupported GGUF version 1")
    expect_error(tmp_path, raw_gguf(arch=False), "no general.architecture")
    expect_error(tmp_path, raw_gguf(_s("k") + struct.pack("<I", 99), 1), "unknown value type 99")
    expect_error(tmp_path, raw_gguf(_s("general.alignment") + struct.pack("<II", 4, 24), 1), "power of two")
    nested = _s("n") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 0)
    expect_error(tmp_path, raw_gguf(nested, 1), "nests arrays")


def test_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf_facts(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="is a directory"):
        read_gguf_facts(tmp_path)


def test_incomplete_stored_facts() -> None:
    with pytest.raises(GGUFError, match="incomplete"):
        GGUFFacts.from_dict({"architecture": "llama"})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_headers_never_crash(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Random byte edits to the header of a real writer's file: parse or GGUFError, nothing else."""
    base = _fuzz_base(tmp_path_factory)
    blob = bytearray(base)
    header_end = 600  # the metadata and tensor infos of the small file below
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, header_end - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    p = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    p.write_bytes(bytes(blob))
    try:
        read_gguf_facts(p)
    except GGUFError:
        pass


_FUZZ_BASE: list[bytes] = []


def _fuzz_base(factory: pytest.TempPathFactory) -> bytes:
    if not _FUZZ_BASE:
        p = factory.mktemp("base") / "small.gguf"
        w = GGUFWriter(str(p), "llama")
        w.add_block_count(1)
        w.add_head_count(2)
        w.add_head_count_kv([1])
        w.add_token_list(["a", "b", "c"])
        w.add_chat_template("{{ x }}")
        w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), np.float32))
        w.add_tensor("output.weight", np.zeros((4, 8), np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _FUZZ_BASE.append(p.read_bytes())
    return _FUZZ_BASE[0]
