"""`pull_folder`: a Hugging Face repo's onnxruntime-genai folder into the store as the tag's `oga` variant.

The files download one at a time into `<tag folder>/folder.partial/` through the GGUF path's own
steps (`download`: a resumable `.partial` with its identity note; `promote`: checked
against the digest the Hub lists, the LFS sha256 or a small file's git blob id, then renamed). A
pull stopped at any point resumes: finished files are verified again and kept, the unfinished one
continues from its last byte. Only the complete folder goes to `ModelStore.install_folder`, which
checks its layout and renames it into the tag before the manifest names it; until then the store
shows nothing. The caller holds the tag's lock throughout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from ..store import oga_config
from ..errors import ModelDirError
from ..store.folder_checks import check_no_native_code
from ..store.model_dirs import OGA, OGA_CONFIG_FILE, remove_tree
from ..config.settings import Settings
from ..protocol.progress import Progress
from ..store.cache import InstalledModel, ModelStore
from ..store.catalog import CatalogEntry, Variant
from .download import ensure_free_space
from ..protocol.progress import emit
from .hf_folders import RepoFolder
from .sources import RemoteFile

T = TypeVar("T")


class FolderJob(Protocol):
    """What a folder pull needs of the locked pull that runs it (puller.py's job): where the tag
    lives, and the GGUF path's own download and check steps."""

    entry: CatalogEntry
    variant: Variant
    store: ModelStore
    settings: Settings
    progress: Progress
    directory: Path

    def reuse_orphan(self, target: Path, expected_sha: str | None, git_oid: str | None = None,
                     label: str | None = None) -> str | None: ...

    def download(self, url: str, partial: Path, sha: str | None, size: int | None, label: str) -> None: ...

    def promote(self, partial: Path, target: Path, check: Callable[[Path], T]) -> T: ...

    def check_digest(self, path: Path, label: str, expected_sha: str | None, known_sha: str | None = None,
                     git_oid: str | None = None, delete_bad: bool = True) -> str: ...

STAGING_DIR = "folder.partial"  # ends like a partial file, so the stale-partial sweep knows it
PARTIAL_ENDINGS = (".partial", ".partial.json")


def pull_folder(job: FolderJob, folder: RepoFolder) -> InstalledModel:
    """Fetch every file of `folder` (resuming what an earlier pull left) and install it."""
    staging = job.directory / STAGING_DIR
    staging.mkdir(parents=True, exist_ok=True)
    try:
        # A library is refused by its name before a byte of it is fetched, and the config's options
        # before the weights are: the full check (install_folder) then sees the bytes themselves.
        check_no_native_code((rel, None) for rel, _ in folder.files)
        _drop_strays(staging, {rel for rel, _ in folder.files})
        _check_disk(job, staging, folder)
        files = {}
        for rel, remote in sorted(folder.files, key=lambda f: f[0] != OGA_CONFIG_FILE):
            files[rel] = _fetch(job, staging / rel, remote, f"{folder.path}/{rel}" if folder.path else rel)
            if rel == OGA_CONFIG_FILE:
                _check_options(staging / rel)
        emit(job.progress, "writing manifest")
        source = {"kind": "hf", "ref": folder.describe(), "repo": folder.repo, "folder": folder.path}
        return job.store.install_folder(staging, job.entry.name, job.variant.tag, OGA, files, source)
    except ModelDirError as e:
        remove_tree(staging)  # the published bytes do not make a usable folder: nothing to resume
        raise ModelDirError(f"{folder.describe()} is not a usable onnxruntime-genai folder: {e}") from None


def _check_options(config_path: Path) -> None:
    """Refuse the config's session and run options outside the allow-list (its files come later)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # install_folder's check names a config that is not JSON
    if isinstance(config, dict):
        oga_config.checked_files(config)


def _fetch(job: FolderJob, target: Path, remote: RemoteFile, label: str) -> dict[str, Any]:
    """One file of the folder at `target`, verified; its manifest entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sha = job.reuse_orphan(target, remote.sha256, remote.git_oid, label)
    if sha is None:
        partial = target.with_name(target.name + ".partial")
        job.download(remote.url, partial, remote.sha256, remote.size, label)
        sha = job.promote(partial, target,
                          lambda p: job.check_digest(p, label, remote.sha256, git_oid=remote.git_oid))
    return {"sha256": sha, "size": target.stat().st_size}


def _drop_strays(staging: Path, wanted: set[str]) -> None:
    """Delete what an earlier pull left that is no file of the folder now (the repo changed since):
    `install_folder` takes the staging folder whole, so anything else would become part of it."""
    for root, _, names in os.walk(staging):
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(staging).as_posix()
            for ending in PARTIAL_ENDINGS:
                rel = rel[: -len(ending)] if rel.endswith(ending) else rel
            if rel not in wanted:
                path.unlink(missing_ok=True)


def _check_disk(job: FolderJob, staging: Path, folder: RepoFolder) -> None:
    """Refuse before the first byte when what is still missing cannot fit."""
    need = 0
    for rel, remote in folder.files:
        done, partial = staging / rel, staging / f"{rel}.partial"
        have = done.stat().st_size if done.exists() else partial.stat().st_size if partial.exists() else 0
        need += max(0, (remote.size or 0) - have)
    ensure_free_space(staging, need, folder.describe(), job.settings.pull_min_free_disk)
