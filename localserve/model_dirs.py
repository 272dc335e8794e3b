"""Model variants that are folders, not one file: what each kind must hold, and per-file checksums.

Two kinds, told apart by a marker file:

- `onnx`: our converter's export. Required: `model.onnx` (an ONNX ModelProto) and
  `localserve-onnx.json`, which names what the graph alone cannot say:

      {"localserve_onnx": 1, "architecture": "llama",
       "tokenizer": {"gguf_sha256": "<hex>"} | {"file": "tokenizer.json"}}

  The tokenizer is llama.cpp's (a vocab-only load of the GGUF the graph came from, named by its
  digest) or a `tokenizer.json` inside the folder. Optional keys (`flavour`, `context_length`, ...)
  are kept as they are.
- `oga`: an onnxruntime-genai folder as AMD, Qualcomm and Intel publish NPU builds: required
  `genai_config.json` whose `model.decoder.filename` names a file in the folder, and `tokenizer.json`
  (OGA's tokenizer reads it).

A folder's checksum is the sha256 of its sorted `sha256  size  path` listing, so one digest names
the whole folder and the per-file entries say which file changed. Symlinks are refused: a link can
point outside the folder, and we copy what we checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .errors import ModelDirError

ONNX = "onnx"
OGA = "oga"
ONNX_MODEL_FILE = "model.onnx"
ONNX_META_FILE = "localserve-onnx.json"
ONNX_META_VERSION = 1
OGA_CONFIG_FILE = "genai_config.json"
OGA_TOKENIZER_FILE = "tokenizer.json"
MAX_FILES = 10_000  # a model folder holds a handful; a home directory given by mistake holds millions
_CHUNK = 1 << 20

Files = dict[str, dict[str, Any]]  # relative POSIX path -> {"sha256": hex, "size": bytes}


def detect_kind(directory: Path) -> str:
    """`onnx` or `oga` for a model folder, by its marker file; ModelDirError when it is neither."""
    if (directory / OGA_CONFIG_FILE).is_file():
        return OGA
    if (directory / ONNX_META_FILE).is_file() or (directory / ONNX_MODEL_FILE).is_file():
        return ONNX
    raise ModelDirError(
        f"folder {directory.name!r} is not a model folder: expected {ONNX_MODEL_FILE} + {ONNX_META_FILE} "
        f"(ONNX) or {OGA_CONFIG_FILE} + {OGA_TOKENIZER_FILE} (onnxruntime-genai)"
    )


def _inside(directory: Path, rel: Any, what: str) -> Path:
    """`rel` as a file inside `directory`; metadata naming a path outside it is corrupt, not a lookup."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ModelDirError(f"{what} must name a file inside the folder (got {str(rel)[:60]!r})")
    path = directory / rel
    if not path.is_file():
        raise ModelDirError(f"the folder has no {rel} ({what})")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path.name} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path.name} must hold a JSON object")
    return data


def _check_onnx_graph(path: Path) -> None:
    # Without importing onnx: a serialized ModelProto starts with field 1 (ir_version, a varint),
    # whose tag byte is 0x08. This catches a truncated-to-empty file or a wrong file named model.onnx.
    with open(path, "rb") as f:
        head = f.read(2)
    if len(head) < 2 or head[0] != 0x08:
        raise ModelDirError(f"{path.name} is not an ONNX model (empty or not a serialized ModelProto)")


_MAX_GRAPH_PARSE = 64 << 20  # larger graphs embed their weights and name no external files


def _check_external_data(graph: Path) -> None:
    """Every external-data file the graph names exists beside it and holds the bytes it points at,
    so a folder copied without its (multi-GB) weights file is refused at add, not at first load.
    Skipped when onnx is not installed (the graph was still checked to be a ModelProto)."""
    if graph.stat().st_size > _MAX_GRAPH_PARSE:
        return
    try:
        import onnx
        from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data
    except ImportError:
        return
    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - onnx raises DecodeError and others for a bad file
        raise ModelDirError(f"{graph.name} is not a readable ONNX model ({type(e).__name__})") from None
    sizes: dict[str, int] = {}
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = _inside(graph.parent, info.location, f"{graph.name}'s external data")
        size = sizes.setdefault(info.location, location.stat().st_size)
        if (info.offset or 0) + (info.length or 0) > size:
            raise ModelDirError(f"{info.location} is shorter than {graph.name} says (truncated?)")


def check_layout(directory: Path, kind: str) -> dict[str, Any]:
    """Raise ModelDirError unless `directory` holds every file `kind` requires; returns the
    metadata (localserve-onnx.json or genai_config.json) for the manifest."""
    if kind == ONNX:
        meta_path = _inside(directory, ONNX_META_FILE, "the converter's metadata")
        _check_onnx_graph(_inside(directory, ONNX_MODEL_FILE, "the graph"))
        meta = _read_json(meta_path)
        if meta.get("localserve_onnx") != ONNX_META_VERSION:
            raise ModelDirError(f"{ONNX_META_FILE}: 'localserve_onnx' must be {ONNX_META_VERSION} "
                                f"(got {meta.get('localserve_onnx')!r})")
        if not isinstance(meta.get("architecture"), str) or not meta["architecture"]:
            raise ModelDirError(f"{ONNX_META_FILE}: 'architecture' is missing")
        tokenizer = meta.get("tokenizer")
        if isinstance(tokenizer, dict) and "file" in tokenizer:
            _inside(directory, tokenizer["file"], f"{ONNX_META_FILE} tokenizer.file")
        elif not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("gguf_sha256"), str)
                  and len(tokenizer["gguf_sha256"]) == 64):
            raise ModelDirError(f"{ONNX_META_FILE}: 'tokenizer' must be {{\"gguf_sha256\": <64 hex>}} "
                                "or {\"file\": <tokenizer.json in the folder>}")
        return meta
    if kind == OGA:
        config = _read_json(_inside(directory, OGA_CONFIG_FILE, "onnxruntime-genai's config"))
        decoder = (config.get("model") or {}).get("decoder") if isinstance(config.get("model"), dict) else None
        if not isinstance(decoder, dict) or "filename" not in decoder:
            raise ModelDirError(f"{OGA_CONFIG_FILE}: model.decoder.filename is missing")
        graph = _inside(directory, decoder["filename"], f"{OGA_CONFIG_FILE} model.decoder.filename")
        _check_onnx_graph(graph)
        _check_external_data(graph)
        _inside(directory, OGA_TOKENIZER_FILE, "the tokenizer")
        return {"model_type": (config.get("model") or {}).get("type")}
    raise ModelDirError(f"unknown model folder kind {kind!r}")


def _walk(directory: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            if path.is_symlink():
                raise ModelDirError(f"{rel} is a symbolic link; copy the real file into the folder")
            if name in files:
                if not path.is_file():
                    raise ModelDirError(f"{rel} is not a regular file")
                found.append((rel, path))
        if len(found) > MAX_FILES:
            raise ModelDirError(f"the folder holds more than {MAX_FILES} files; is it a model folder?")
    return sorted(found)


def copy_and_hash(source: Path, target: Path) -> Files:
    """Copy every file of `source` into the new folder `target`, hashing the bytes as they are
    written, so the checksums describe the copy the store keeps (not a source that may change)."""
    files: Files = {}
    for rel, path in _walk(source):
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        with open(path, "rb") as src, open(dest, "wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        files[rel] = {"sha256": digest.hexdigest(), "size": size}
    if not files:
        raise ModelDirError(f"folder {source.name!r} is empty")
    return files


def tree_digest(files: Files) -> str:
    listing = "".join(f"{e['sha256']}  {e['size']}  {rel}\n" for rel, e in sorted(files.items()))
    return hashlib.sha256(listing.encode("utf-8")).hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_tree(directory: Path, files: Files, label: str) -> None:
    """Raise ModelDirError naming the files that are missing, added, resized or changed."""
    if not directory.is_dir():
        raise ModelDirError(f"the folder of {label} is missing; add it again")
    present = {rel: path for rel, path in _walk(directory)}
    problems = [f"{rel} missing" for rel in sorted(set(files) - set(present))]
    problems += [f"{rel} not in the manifest" for rel in sorted(set(present) - set(files))]
    for rel in sorted(set(files) & set(present)):
        expected = files[rel]
        if present[rel].stat().st_size != expected["size"]:
            problems.append(f"{rel} has the wrong size")
        elif _sha256_of(present[rel]) != expected["sha256"]:
            problems.append(f"{rel} has the wrong sha256")
    if problems:
        shown = ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ModelDirError(f"{label} is corrupt: {shown}; add it again")


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
