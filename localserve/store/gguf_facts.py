"""What a GGUF file says about its model, read from the header only.

We parse the header ourselves with bounded reads instead of `gguf.GGUFReader`: the reader
memory-maps the whole file, builds numpy views of every tensor and trusts every length field, so a
truncated download or a garbage file surfaces as an arbitrary numpy/struct exception or a
multi-gigabyte allocation from a forged array length. Here every count and length is checked
against hard caps and against the bytes that remain in the file before anything is allocated, and
every tensor's extent is checked against the file size. The `gguf` package still supplies the
tables (value types, tensor type block sizes, llama file-type names), so new quant types are
picked up by upgrading it.

Layout (GGUF v2/v3, little- or big-endian): magic "GGUF", u32 version, u64 tensor count,
u64 metadata count, metadata (key string, u32 type, value), tensor infos (name, u32 n_dims,
u64 dims[n_dims], u32 type, u64 offset relative to the aligned data section), padding, data.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from ..errors import GGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4

# Hard caps, far above any real model (Llama-3.1-405B has ~1.1k tensors and ~40 metadata keys; the
# largest vocabularies are ~262k tokens) but low enough that a forged header cannot make us loop
# for minutes or allocate gigabytes.
MAX_METADATA = 1 << 16
MAX_TENSORS = 1 << 16  # a tensor info takes >= 24 bytes of file but ~300 bytes of Python objects
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24
MAX_ARRAY_LEN = 1 << 26
MAX_ARRAY_DEPTH = 2
# Metadata values parsed one by one (strings, nested arrays) over the whole header: bounds the
# time a forged header can keep us busy. Gemma 3's 262k-token vocabulary needs ~0.8M.
MAX_ITEMS = 1 << 24
# Arrays we actually keep in memory; longer ones (token lists, merges, scores) are skipped and only
# their length is remembered.
KEEP_ARRAY_LEN = 4096
# Array items kept in memory over the whole header. Each kept item costs a list slot and often an
# object (8-60 bytes) for as little as one byte of file, so without a total a header of nested
# byte arrays made the parser hold ~8x the file's size; with it, what a header can make us hold
# is a few MB beyond its strings' own bytes. Real models keep a few hundred items (per-layer
# values); arrays past the total are skipped like long ones and reported as ArrayInfo.
MAX_KEPT_ITEMS = 1 << 18

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_MIN_VALUE_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# A MoE layer's expert stacks, as llama.cpp's --cpu-moe matches them (common/common.h LLM_FFN_EXPS_REGEX).
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_EXPERTS_RE = re.compile(EXPERTS_REGEX)


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array too long to keep (e.g. tokenizer.ggml.tokens): only its type and length."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFFacts:
    """The model facts the catalog, `show`, the memory estimate and the placement need."""

    architecture: str
    name: str | None
    n_params: int  # sum of all tensors' element counts
    n_layers: int
    n_heads: int
    n_kv_heads: int  # the largest per-layer value when the file gives one per layer
    n_embd: int
    head_dim: int  # K head size
    head_dim_v: int  # V head size (differs from head_dim in e.g. DeepSeek MLA)
    context_length: int  # trained context
    quant: str  # human name: "Q4_1", "Q4_K_M", "F16", ...
    file_type_id: int | None  # raw general.file_type (llama_ftype)
    tokenizer_model: str | None  # "gpt2", "llama", ...
    vocab_size: int
    chat_template: str | None
    license: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    file_size: int
    tensor_count: int
    weights_bytes: int  # bytes of all tensor data
    layer_bytes: int  # bytes of the repeating blocks (blk.N.*), all layers together
    largest_layer_bytes: int  # the biggest single block (placement sizes offload by it)
    kv_heads_all_layers: int  # sum of KV heads over layers; 0 on recurrent (SSM) layers of hybrids
    gguf_version: int
    # MoE expert stacks (blk.N.ffn_{gate,up,down}_exps), all layers: what cpu_moe keeps in RAM.
    expert_bytes: int = 0

    @property
    def file_type(self) -> str:
        return self.quant

    @property
    def non_layer_bytes(self) -> int:
        """Embeddings, output head and final norm: what stays outside the repeating blocks."""
        return self.weights_bytes - self.layer_bytes

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GGUFFacts":
        """Rebuild from `as_dict()` output (a manifest); unknown keys are ignored, so older or newer
        manifests still load; missing keys are an error because every estimate depends on them."""
        names = {f.name for f in fields(cls)}
        # A field with a default came later; a manifest from before it still describes the model.
        missing = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - data.keys()
        if missing:
            raise GGUFError(f"stored model facts are incomplete (missing {', '.join(sorted(missing))})")
        return cls(**{k: data[k] for k in names if k in data})


class _Reader:
    """Bounded sequential reads: every read is checked against the file size before it happens."""

    def __init__(self, f: BinaryIO, size: int, label: str):
        self.f = f
        self.size = size
        self.label = label
        self.pos = 0
        self.endian = "<"
        self.items = 0
        self.kept = 0

    def count(self, n: int) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise self.fail(f"metadata has more than {MAX_ITEMS} values; the header is corrupt")

    def keep(self, n: int) -> bool:
        """Whether an array of `n` items may be held in memory (charged against MAX_KEPT_ITEMS)."""
        if n > KEEP_ARRAY_LEN or self.kept + n > MAX_KEPT_ITEMS:
            return False
        self.kept += n
        return True

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.label}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"file is truncated ({what} at byte {self.pos} runs past the end of the file)")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.f.read(n)
        if len(data) != n:  # the file shrank under us
            raise self.fail(f"file is truncated ({what} at byte {self.pos})")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(self.endian + fmt, self.read(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str, limit: int = MAX_STRING_BYTES, keep: bool = True) -> str | None:
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.fail(f"{what} is {n} bytes long (limit {limit}); the header is corrupt")
        if not keep:
            self.skip(n, what)
            return None
        return self.read(n, what).decode("utf-8", errors="replace")


def _value_type(r: _Reader, raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise r.fail(f"{what} has unknown value type {raw}") from None


def _read_value(r: _Reader, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
    if vtype in _SCALAR_FORMATS:
        return r.scalar(_SCALAR_FORMATS[vtype], what)
    if vtype == GGUFValueType.STRING:
        return r.string(what)
    # ARRAY
    if depth >= MAX_ARRAY_DEPTH:
        raise r.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    item_type = _value_type(r, r.u32(f"{what} item type"), what)
    length = r.u64(f"{what} length")
    # A forged length cannot be larger than what the remaining bytes could possibly encode.
    if length > MAX_ARRAY_LEN or length * _MIN_VALUE_BYTES[item_type] > r.size - r.pos:
        raise r.fail(f"{what} claims {length} items, more than the file can hold (truncated or corrupt)")
    if item_type not in _SCALAR_FORMATS:
        r.count(length)
    if r.keep(length):
        return [_read_value(r, item_type, what, depth + 1) for _ in range(length)]
    if item_type in _SCALAR_FORMATS:
        r.skip(length * struct.calcsize(_SCALAR_FORMATS[item_type]), what)
    elif item_type == GGUFValueType.STRING:
        for _ in range(length):
            r.string(what, keep=False)
    else:
        for _ in range(length):
            _read_value(r, item_type, what, depth + 1)
    return ArrayInfo(int(item_type), length)


@dataclass(slots=True)
class _Tensor:
    name: str
    n_elements: int
    ggml_type: int
    offset: int
    n_bytes: int


def _read_header(f: BinaryIO, size: int, label: str) -> tuple[int, dict[str, Any], list[_Tensor]]:
    r = _Reader(f, size, label)
    if size < 4 or r.read(4, "magic") != GGUF_MAGIC:
        raise r.fail("not a GGUF file (missing the 'GGUF' magic)")
    raw = r.read(4, "version")
    version = struct.unpack("<I", raw)[0]
    if version > 0xFFFF and struct.unpack(">I", raw)[0] <= 0xFFFF:
        # Big-endian GGUF (s390x conversions): same layout, every number swapped.
        r.endian, version = ">", struct.unpack(">I", raw)[0]
    if version not in (2, 3):
        raise r.fail(f"unsupported GGUF version {version} (localserve reads versions 2 and 3)")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata count")
    if n_kv > MAX_METADATA:
        raise r.fail(f"header claims {n_kv} metadata entries (limit {MAX_METADATA}); the header is corrupt")
    # Smallest possible tensor info: empty name (8) + n_dims (4) + type (4) + offset (8).
    if n_tensors > MAX_TENSORS or n_tensors * 24 > size:
        raise r.fail(f"header claims {n_tensors} tensors, more than the file can hold (truncated or corrupt)")

    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}", limit=MAX_KEY_BYTES)
        assert key is not None
        vtype = _value_type(r, r.u32(f"type of {key!r}"), repr(key))
        meta[key] = _read_value(r, vtype, repr(key))

    tensors: list[_Tensor] = []
    for i in range(n_tensors):
        name = r.string(f"tensor name #{i}", limit=MAX_KEY_BYTES)
        assert name is not None
        n_dims = r.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (ggml allows 1 to {GGML_MAX_DIMS})")
        dims = [r.u64(f"dimensions of {name!r}") for _ in range(n_dims)]
        raw_type = r.u32(f"type of tensor {name!r}")
        offset = r.u64(f"offset of tensor {name!r}")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise r.fail(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elements = math.prod(dims)
        if dims[0] % block:
            raise r.fail(f"tensor {name!r} row size {dims[0]} is not a multiple of its block size {block}")
        tensors.append(_Tensor(name, n_elements, raw_type, offset, n_elements // block * type_size))

    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-r.pos // alignment) * alignment
    _check_extents(r, tensors, data_start, alignment)
    return version, meta, tensors


def _check_extents(r: _Reader, tensors: list[_Tensor], data_start: int, alignment: int) -> None:
    """Every tensor must lie inside the file, aligned, and not overlap another: a truncated
    download passes the header but fails here, which is what keeps it out of the cache."""
    names: set[str] = set()
    end_prev, prev_name = data_start, None
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.name in names:
            raise r.fail(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        if t.offset % alignment:
            raise r.fail(f"tensor {t.name!r} offset {t.offset} is not aligned to {alignment}")
        start = data_start + t.offset
        if start < end_prev:
            raise r.fail(f"tensor {t.name!r} overlaps tensor {prev_name!r}")
        end = start + t.n_bytes
        if end > r.size:
            raise r.fail(
                f"file is truncated: tensor {t.name!r} ends at byte {end} but the file has {r.size} bytes"
            )
        end_prev, prev_name = end, t.name


def _int(meta: dict[str, Any], key: str, default: int = 0) -> int:
    value = meta.get(key, default)
    if isinstance(value, list):  # per-layer values (e.g. head counts of OpenELM, hybrids)
        value = max((v for v in value if isinstance(v, (int, float))), default=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return int(value)


def _str(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _opt_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _quant_name(file_type: int | None, tensors: list[_Tensor]) -> str:
    """llama.cpp's file type name (Q4_K_M, ...), else the type holding most bytes of 2D weights."""
    if file_type is not None:
        try:
            name = LlamaFileType(file_type & ~LlamaFileType.GUESSED).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    by_type: dict[int, int] = {}
    for t in tensors:
        if t.name.endswith(".weight") and t.n_elements > 0:
            by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.n_bytes
    if not by_type:
        return "unknown"
    return GGMLQuantizationType(max(by_type, key=by_type.__getitem__)).name


def _facts(version: int, meta: dict[str, Any], tensors: list[_Tensor], file_size: int, label: str) -> GGUFFacts:
    arch = _str(meta, "general.architecture")
    if not arch:
        raise GGUFError(f"{label}: GGUF file has no general.architecture; it is not a model file")
    a = f"{arch}."
    n_layers = _int(meta, a + "block_count")
    n_heads = _int(meta, a + "attention.head_count")
    n_embd = _int(meta, a + "embedding_length")
    n_kv_heads = _int(meta, a + "attention.head_count_kv", n_heads)
    raw_kv = meta.get(a + "attention.head_count_kv", n_kv_heads)
    if isinstance(raw_kv, list):
        kv_all = sum(int(v) for v in raw_kv if isinstance(v, (int, float)) and not isinstance(v, bool))
    else:
        kv_all = n_kv_heads * n_layers
    head_dim = _int(meta, a + "attention.key_length", n_embd // n_heads if n_heads else 0)
    head_dim_v = _int(meta, a + "attention.value_length", head_dim)

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else 0
    vocab = vocab or _int(meta, a + "vocab_size")

    layer_sizes: dict[int, int] = {}
    expert_bytes = 0
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m:
            layer_sizes[int(m.group(1))] = layer_sizes.get(int(m.group(1)), 0) + t.n_bytes
            expert_bytes += t.n_bytes if _EXPERTS_RE.search(t.name) else 0
    file_type = _opt_int(meta, "general.file_type")
    return GGUFFacts(
        architecture=arch,
        name=_str(meta, "general.name"),
        n_params=sum(t.n_elements for t in tensors),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        n_embd=n_embd,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        context_length=_int(meta, a + "context_length"),
        quant=_quant_name(file_type, tensors),
        file_type_id=file_type,
        tokenizer_model=_str(meta, "tokenizer.ggml.model"),
        vocab_size=vocab,
        chat_template=_str(meta, "tokenizer.chat_template"),
        license=_str(meta, "general.license"),
        bos_token_id=_opt_int(meta, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_opt_int(meta, "tokenizer.ggml.eos_token_id"),
        file_size=file_size,
        tensor_count=len(tensors),
        weights_bytes=sum(t.n_bytes for t in tensors),
        layer_bytes=sum(layer_sizes.values()),
        largest_layer_bytes=max(layer_sizes.values(), default=0),
        kv_heads_all_layers=kv_all,
        gguf_version=version,
        expert_bytes=expert_bytes,
    )


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All metadata key/values of a GGUF file (long arrays as `ArrayInfo`), bounded like the facts."""
    return _parse(Path(path))[1]


def read_gguf_facts(path: str | os.PathLike[str]) -> GGUFFacts:
    """Parse and validate the header of `path`; raise GGUFError (never anything else) if it is not
    a complete, well-formed GGUF model file. A split model (llama.cpp's gguf-split shards,
    "NAME-00001-of-00003.gguf") is read through its first shard: every shard's header is checked
    and the facts cover the whole model, as llama.cpp loads it."""
    p = Path(path)
    version, meta, tensors, size = _parse(p)
    count = _int(meta, "split.count")
    if count > 1:
        tensors, size = _read_shards(p, meta, count, tensors, size)
    return _facts(version, meta, tensors, size, _label(p))


_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 1000


def _read_shards(first: Path, meta: dict[str, Any], count: int, tensors: list[_Tensor], size: int) -> tuple[list[_Tensor], int]:
    label = _label(first)
    no = _int(meta, "split.no")
    m = _SPLIT_NAME.match(first.name)
    if no != 0:
        raise GGUFError(f"{label} is part {no + 1} of {count} of a split model; use the first part")
    if count > MAX_SHARDS or not m or int(m.group("count")) != count:
        raise GGUFError(f"{label}: split model of {count} parts, but the name does not follow NAME-00001-of-{count:05d}.gguf")
    seen = {t.name for t in tensors}
    for i in range(2, count + 1):
        shard = first.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf")
        if not shard.exists():
            raise GGUFError(f"{label}: part {i} of {count} ({shard.name}) is missing")
        _, shard_meta, shard_tensors, shard_size = _parse(shard)
        if _int(shard_meta, "split.no") != i - 1 or _int(shard_meta, "split.count") != count:
            raise GGUFError(f"{shard.name} is not part {i} of {count} of the same split model")
        for t in shard_tensors:
            if t.name in seen:
                raise GGUFError(f"{shard.name}: tensor {t.name!r} appears in two parts")
            seen.add(t.name)
        tensors = tensors + shard_tensors
        size += shard_size
    return tensors, size


def _label(p: Path) -> str:
    return p.name or "model file"  # messages name the file, never the host path around it


def _parse(p: Path) -> tuple[int, dict[str, Any], list[_Tensor], int]:
    label = _label(p)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            version, meta, tensors = _read_header(f, size, label)
    except FileNotFoundError:
        raise GGUFError(f"{label}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{label}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise GGUFError(f"{label}: permission denied") from None
    except OSError as e:
        raise GGUFError(f"{label}: cannot read file ({e.strerror or e})") from None
    return version, meta, tensors, size
