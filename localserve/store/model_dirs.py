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

Both kinds are data, never code (folder_checks, oga_config): every name a config or graph holds
stays inside the folder, no library or program is taken from it, and genai_config.json's session
options come from an allow-list. check_layout says so at add, at pull and before each load.

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

from . import oga_config
from ..errors import ModelDirError
from .folder_checks import check_graph, check_no_native_code, inside

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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path.name} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path.name} must hold a JSON object")
    return data


def _check_onnx(directory: Path) -> dict[str, Any]:
    meta = _read_json(inside(directory, ONNX_META_FILE, "the converter's metadata"))
    if meta.get("localserve_onnx") != ONNX_META_VERSION:
        raise ModelDirError(f"{ONNX_META_FILE}: 'localserve_onnx' must be {ONNX_META_VERSION} "
                            f"(got {meta.get('localserve_onnx')!r})")
    if not isinstance(meta.get("architecture"), str) or not meta["architecture"]:
        raise ModelDirError(f"{ONNX_META_FILE}: 'architecture' is missing")
    tokenizer = meta.get("tokenizer")
    if isinstance(tokenizer, dict) and "file" in tokenizer:
        inside(directory, tokenizer["file"], f"{ONNX_META_FILE} tokenizer.file")
    elif not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("gguf_sha256"), str)
              and len(tokenizer["gguf_sha256"]) == 64):
        raise ModelDirError(f"{ONNX_META_FILE}: 'tokenizer' must be {{\"gguf_sha256\": <64 hex>}} "
                            "or {\"file\": <tokenizer.json in the folder>}")
    check_graph(directory, ONNX_MODEL_FILE, "the graph")
    # The static flavour's per-bucket graphs (backends/onnx_static.py opens each one).
    static = meta.get("static") if isinstance(meta.get("static"), dict) else {}
    graphs = static.get("graphs") if isinstance(static.get("graphs"), dict) else {}
    for bucket, name in graphs.items():
        if name != ONNX_MODEL_FILE:
            check_graph(directory, name, f"{ONNX_META_FILE} static.graphs[{str(bucket)[:20]}]")
    return meta


def _check_oga(directory: Path) -> dict[str, Any]:
    config = _read_json(inside(directory, OGA_CONFIG_FILE, "onnxruntime-genai's config"))
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    decoder = model.get("decoder")
    if not isinstance(decoder, dict) or not isinstance(decoder.get("filename"), str):
        raise ModelDirError(f"{OGA_CONFIG_FILE}: model.decoder.filename is missing")
    checked: set[str] = set()
    for field, rel in oga_config.checked_files(config):
        if rel in checked:  # several sections may share one graph: parse it once
            continue
        checked.add(rel)
        what = f"{OGA_CONFIG_FILE} {field}"
        if rel.lower().endswith(".onnx") or field == "model.decoder.filename":
            check_graph(directory, rel, what)
        else:
            inside(directory, rel, what)
    inside(directory, OGA_TOKENIZER_FILE, "the tokenizer")
    return {"model_type": model.get("type")}


def check_layout(directory: Path, kind: str) -> dict[str, Any]:
    """Raise ModelDirError unless `directory` holds every file `kind` requires, every name its graphs
    and configs hold stays inside it, and it holds no library or program (folder_checks); returns
    the metadata (localserve-onnx.json or genai_config.json facts) for the manifest. Run at add, at
    pull (install_folder) and again before each load."""
    if kind not in (ONNX, OGA):
        raise ModelDirError(f"unknown model folder kind {kind!r}")
    check_no_native_code(_walk(directory))
    return _check_onnx(directory) if kind == ONNX else _check_oga(directory)


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
