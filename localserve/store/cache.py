"""The model cache on disk: readable names, one manifest per model, inter-process locks.

Layout under `settings.models_dir`:

    models/<name>/<tag>/<file>.gguf      the weights (absent for models registered in place)
    models/<name>/<tag>/<kind>-<digest>/ a folder variant (ONNX export, onnxruntime-genai folder)
    models/<name>/<tag>/folder.partial/  a folder a pull is still fetching (pull/folder.py)
    models/<name>/<tag>/manifest.json    source, sha256, size, GGUF facts, pulled_at, variants
    models/.locks/<name>@<tag>.lock      held while a pull or removal of that model runs

A model is visible only once its manifest exists, and the manifest is written last (atomically), so
a crash mid-pull never shows a half-written model. Every path built from a user-supplied name goes
through `safe_component` (names.py): a name is the one thing a remote client (Ollama's /api/pull, /api/delete)
controls that becomes a path, so it is the door a traversal attack would use.

A tag holds one variant per format. The manifest's top-level `file`, `sha256`, `size`, `facts` are
the GGUF variant (the schema-1 layout, so every manifest written before variants existed reads as a
tag with one GGUF variant); `variants` maps each folder format (`onnx`, `oga`) to its own entry:
`dir`, `sha256` of the folder's listing, and `files` with every file's sha256 and size
(model_dirs.py). A folder is copied into a staging folder under `models/.tmp` (same filesystem),
checked there, then renamed into the tag's folder before the manifest names it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..config.settings import Settings
from ..errors import LocalserveError, ModelNotFoundError, PullLockedError
from . import prompt_cache
from .lora import MANIFEST_KEY as LORA_KEY, adapter_paths, check_adapter, local_entries
from .projector import MANIFEST_KEY as PROJECTOR_KEY, check_projector, local_entry, projector_path
from .names import name_to_dir, safe_component  # noqa: F401  (callers take them from the cache too)

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = 2  # 2: `variants` for folder formats; schema-1 manifests read as one GGUF variant
LOCKS_DIR = ".locks"
def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON so readers see the old or the new file, never a torn one (tmp + fsync + replace)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class FileLock:
    """An exclusive inter-process lock on a file (fcntl on POSIX, msvcrt on Windows).

    The lock belongs to the open file description, so it is released by the OS if the holder dies
    (a killed pull never leaves a stale lock behind, unlike pid files). `timeout` bounds the wait of
    `with lock:` (PullLockedError after it), so a thread never waits forever behind a stuck holder.
    """

    def __init__(self, path: Path, timeout: float | None = None):
        self.path = path
        self.timeout = timeout
        self._fd: int | None = None

    def acquire(self, blocking: bool = True, poll: float = 0.2, timeout: float | None = None) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if _try_lock(fd):
                    self._fd = fd
                    return True
                if not blocking or (deadline is not None and time.monotonic() >= deadline):
                    os.close(fd)
                    return False
                time.sleep(poll)
        except BaseException:  # an odd lock error or Ctrl-C while waiting: do not leak the descriptor
            os.close(fd)
            raise

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        if not self.acquire(timeout=self.timeout):
            raise PullLockedError(f"{self.path.stem.replace('@', ':')} is busy (another pull or removal of it is "
                                  "in progress); try again when it finishes")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


@dataclass(frozen=True)
class StoredVariant:
    """One format of a tag: the GGUF file, or a folder with per-file checksums."""

    format: str  # "gguf", "onnx" (our converter's export) or "oga" (an onnxruntime-genai folder)
    path: Path  # the .gguf file, or the variant's folder
    size: int
    sha256: str | None  # of the file, or of the folder's file listing
    files: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # folders only
    meta: dict[str, Any] = field(default_factory=dict, repr=False)  # localserve-onnx.json / genai_config facts

    @property
    def available(self) -> bool:
        return self.path.is_file() if self.format == "gguf" else self.path.is_dir()

    def verify(self, label: str) -> None:
        """Check a folder variant against its per-file manifest (ModelDirError naming what differs)."""
        if self.format != "gguf":
            from .model_dirs import verify_tree

            verify_tree(self.path, self.files, f"the {self.format} variant of {label}")


@dataclass
class InstalledModel:
    name: str
    tag: str
    path: Path  # the .gguf file (inside the cache, or the user's own file for models added in place)
    size: int
    sha256: str | None
    quant: str | None
    format: str
    modified: float  # epoch seconds of the pull / registration
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)
    # Every format the tag holds; `path`, `size`, `sha256`, `format` above are the GGUF one's when
    # there is one (what llama.cpp and the pull code use), else the first folder variant's.
    variants: dict[str, StoredVariant] = field(default_factory=dict, repr=False)
    # The vision projector stored with the tag (store/projector.py), None without one: what the
    # engine's load takes as its `mmproj` path.
    mmproj: Path | None = None
    # The LoRA adapters stored with the tag (store/lora.py), in id order.
    loras: list[Path] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def in_place(self) -> bool:
        return bool(self.manifest.get("in_place"))

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.manifest.get("facts") or {})

    @property
    def available(self) -> bool:
        return any(v.available for v in self.variants.values())

    @property
    def gguf(self) -> StoredVariant | None:
        return self.variants.get("gguf")


def _local_file(path: Path | str) -> Path:
    source = Path(path).expanduser()
    if not source.is_file():
        raise ModelNotFoundError(str(path), message=f"no such file: {source.name}")
    return source.resolve()


class ModelStore:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.root = settings.models_dir

    # -- paths -------------------------------------------------------------------------------
    def model_dir(self, name: str, tag: str) -> Path:
        return self.root / name_to_dir(name) / safe_component(tag, "tag")

    def lock(self, name: str, tag: str) -> FileLock:
        return FileLock(self.root / LOCKS_DIR / f"{name_to_dir(name)}@{safe_component(tag, 'tag')}.lock",
                        timeout=self.settings.pull_lock_timeout)

    def tmp_dir(self) -> Path:
        path = self.root / ".tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- reading -----------------------------------------------------------------------------
    def _manifests(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for name_dir in sorted(self.root.iterdir()):
            if name_dir.name.startswith(".") or not name_dir.is_dir():
                continue
            for tag_dir in sorted(name_dir.iterdir()):
                manifest = tag_dir / MANIFEST_NAME
                if manifest.is_file():
                    yield manifest

    def _load(self, manifest_path: Path) -> InstalledModel | None:
        try:
            data = json.loads(manifest_path.read_text(encoding="utf-8"))
            variants = _read_variants(data, manifest_path.parent)
            if not variants:
                raise ValueError("the manifest names no file and no variant")
            primary = variants.get("gguf") or next(iter(variants.values()))
            return InstalledModel(
                name=str(data["name"]),
                tag=str(data["tag"]),
                path=primary.path,
                size=primary.size,
                sha256=primary.sha256,
                quant=data.get("quant"),
                format=primary.format,
                modified=float(data.get("pulled_at_epoch") or manifest_path.stat().st_mtime),
                manifest=data,
                variants=variants,
                mmproj=projector_path(data, manifest_path.parent),
                loras=adapter_paths(data),
            )
        except (OSError, ValueError, KeyError, TypeError, LocalserveError) as e:
            # One damaged manifest must not hide every other model.
            log.warning("ignoring unreadable manifest %s: %s", manifest_path, e)
            return None

    def list(self) -> list[InstalledModel]:
        models = [m for m in (self._load(p) for p in self._manifests()) if m is not None]
        return sorted(models, key=lambda m: (m.name, m.tag))

    def get(self, name: str, tag: str) -> InstalledModel | None:
        """The installed model with exactly this name and tag, or None."""
        manifest = self.model_dir(name, tag) / MANIFEST_NAME
        return self._load(manifest) if manifest.is_file() else None

    def find(self, ref: str) -> InstalledModel:
        """An installed model by `name[:tag]` (tag case-insensitive). Without a tag: the catalog's
        default tag, else `latest`, else the only installed tag."""
        from .catalog import canonical_name, load_catalog, parse_ref

        parsed = parse_ref(ref)
        name = canonical_name(parsed.name)
        installed = self.list()
        same_name = [m for m in installed if m.name.lower() == name.lower()]
        if not same_name:
            refs = sorted({m.name for m in installed} | {m.ref for m in installed})
            import difflib

            raise ModelNotFoundError(
                ref,
                difflib.get_close_matches(ref, refs, n=3, cutoff=0.5),
                message=f"model {ref!r} is not installed (try `localserve pull {ref}`)",
            )
        if parsed.tag is not None:
            for m in same_name:
                if m.tag.lower() == parsed.tag.lower():
                    return m
            if parsed.tag.lower() != "latest":  # `name:latest` from Ollama clients means "the default"
                raise ModelNotFoundError(ref, [m.ref for m in same_name], message=f"model {ref!r} is not installed")
        if len(same_name) == 1:
            return same_name[0]
        preferred = ["latest"]
        try:
            preferred.insert(0, load_catalog(self.settings).resolve(name).variant.tag)
        except LocalserveError:
            pass
        for tag in preferred:
            for m in same_name:
                if m.tag.lower() == tag.lower():
                    return m
        raise ModelNotFoundError(
            ref, [m.ref for m in same_name], message=f"model {ref!r} has several tags installed; name one"
        )

    # -- writing -----------------------------------------------------------------------------
    def write_manifest(self, name: str, tag: str, data: dict[str, Any]) -> InstalledModel:
        """Write the tag's manifest with `data` as its GGUF variant, keeping the folder variants it
        already has (a re-pull of the GGUF must not drop a converted ONNX). Callers hold the lock."""
        directory = self.model_dir(name, tag)
        directory.mkdir(parents=True, exist_ok=True)
        existing = self._raw_manifest(directory)
        full = self._manifest_head(name, tag)
        full.update({"format": "gguf", **data})
        if existing.get("variants"):
            full["variants"] = existing["variants"]
        return self._commit_manifest(directory, full)

    def _raw_manifest(self, directory: Path) -> dict[str, Any]:
        try:
            data = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _manifest_head(name: str, tag: str) -> dict[str, Any]:
        now = time.time()
        return {"schema": MANIFEST_SCHEMA, "name": name, "tag": tag,
                "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "pulled_at_epoch": now}

    def _commit_manifest(self, directory: Path, full: dict[str, Any]) -> InstalledModel:
        atomic_write_json(directory / MANIFEST_NAME, full)
        model = self._load(directory / MANIFEST_NAME)
        assert model is not None
        return model

    def register_local(self, path: Path | str, name: str, tag: str = "latest",
                       mmproj: Path | str | None = None, loras: list[Path | str] = ()) -> InstalledModel:
        """Register a GGUF file the user already has, in place (no copy), after validating it;
        `mmproj`: its vision projector, `loras`: its LoRA adapters, registered in place with it
        (each checked as what it is)."""
        from .verify import facts_to_manifest, read_facts, sha256_file

        name = safe_component(name, "name")
        tag = safe_component(tag, "tag")
        source = _local_file(path)
        facts = read_facts(source)  # raises GGUFError on anything that is not a sane GGUF
        projector = _local_file(mmproj) if mmproj is not None else None
        if projector is not None:
            check_projector(projector, projector.name)
        adapters = [_local_file(p) for p in loras]
        for adapter in adapters:
            check_adapter(adapter, adapter.name, getattr(facts, "architecture", None))
        data = {
            "file": str(source),
            "in_place": True,
            "size": source.stat().st_size,
            "sha256": sha256_file(source),
            "quant": getattr(facts, "quant", None),
            "source": {"kind": "file", "path": str(source)},
            "facts": facts_to_manifest(facts),
        }
        if projector is not None:
            data[PROJECTOR_KEY] = local_entry(projector, sha256_file(projector))
        if adapters:
            data[LORA_KEY] = local_entries(adapters, sha256_file)
        with self.lock(name, tag):
            return self.write_manifest(name, tag, data)

    def add_directory(self, path: Path | str, name: str, tag: str = "latest") -> InstalledModel:
        """Copy an ONNX or onnxruntime-genai model folder into the tag as its `onnx` / `oga` variant.

        The copy is staged under models/.tmp and checked there; only a complete, valid copy is
        renamed into the tag's folder, and the manifest names it after that, so a refused or
        interrupted add leaves nothing the store would show. A GGUF the tag holds stays.
        """
        import tempfile

        from .model_dirs import check_layout, copy_and_hash, detect_kind, remove_tree

        name = safe_component(name, "name")
        tag = safe_component(tag, "tag")
        source = Path(path).expanduser()
        if not source.is_dir():
            raise ModelNotFoundError(str(path), message=f"no such folder: {source.name}")
        kind = detect_kind(source)
        check_layout(source, kind)  # refuse an incomplete folder before copying gigabytes
        staging = Path(tempfile.mkdtemp(prefix=".stage-", dir=self.tmp_dir()))
        try:
            files = copy_and_hash(source, staging / "copy")
            with self.lock(name, tag):
                return self.install_folder(staging / "copy", name, tag, kind, files,
                                           {"kind": "folder", "name": source.name})
        finally:
            remove_tree(staging)

    def install_folder(self, folder: Path, name: str, tag: str, kind: str, files: dict[str, dict[str, Any]],
                       source: dict[str, Any]) -> InstalledModel:
        """Make the complete folder `folder` (on the store's file system, `files` its checksums) the
        tag's `kind` variant: checked, renamed into the tag's folder, then named by the manifest.

        Callers hold the tag's lock: `add_directory` takes it around this call, a pull holds it for
        its whole run (taking it again here would wait on itself). A folder that fails the check
        stays where it is, for the caller to remove."""
        from .model_dirs import check_layout, remove_tree, tree_digest

        meta = check_layout(folder, kind)  # what we keep, not what a source folder holds now
        digest = tree_digest(files)
        directory = self.model_dir(name, tag)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"{kind}-{digest[:12]}"
        if target.is_dir():
            remove_tree(folder)  # the same bytes are installed already
        else:
            os.replace(folder, target)
        manifest = self._raw_manifest(directory)
        old = (manifest.get("variants") or {}).get(kind) or {}
        full = {**manifest, **self._manifest_head(name, tag)}
        full["variants"] = {**(manifest.get("variants") or {}), kind: {
            "format": kind, "dir": target.name, "sha256": digest, "files": files,
            "size": sum(e["size"] for e in files.values()), "meta": meta, "source": source,
        }}
        model = self._commit_manifest(directory, full)
        if old.get("dir") and old["dir"] != target.name:
            remove_tree(directory / safe_component(old["dir"], "variant folder"))
        return model

    def remove(self, ref: str) -> InstalledModel:
        """Delete a model from the cache (never the user's own file for models added in place)."""
        model = self.find(ref)
        directory = self.model_dir(model.name, model.tag)
        with self.lock(model.name, model.tag):
            # The manifest goes first: from this instant the model is invisible, even if the
            # deletion of a multi-GB file is interrupted.
            (directory / MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(directory, ignore_errors=True)
        # Its cached prompts too: they hold conversations, and no other engine can read them.
        prompt_cache.remove_model(self.settings.home, model.sha256)
        try:
            directory.parent.rmdir()
        except OSError:
            pass  # other tags remain
        return model


def _read_variants(data: dict[str, Any], directory: Path) -> dict[str, StoredVariant]:
    """Every variant a manifest names: the top-level GGUF (schema 1 and 2) and the folders."""
    variants: dict[str, StoredVariant] = {}
    if data.get("file"):
        file_ref = Path(data["file"])
        path = file_ref if file_ref.is_absolute() else directory / safe_component(data["file"], "file")
        variants["gguf"] = StoredVariant("gguf", path, int(data.get("size") or 0), data.get("sha256"))
    raw = data.get("variants") or {}
    if not isinstance(raw, dict):
        raise ValueError("'variants' must be an object")
    for kind, entry in raw.items():
        files = entry["files"]
        if not isinstance(files, dict):
            raise ValueError(f"variant {kind}: 'files' must be an object")
        variants[str(kind)] = StoredVariant(
            format=str(entry.get("format") or kind),
            path=directory / safe_component(entry["dir"], "variant folder"),
            size=int(entry.get("size") or 0),
            sha256=entry.get("sha256"),
            files=files,
            meta=dict(entry.get("meta") or {}),
        )
    return variants
