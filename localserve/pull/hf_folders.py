"""onnxruntime-genai (OGA) folders in a Hugging Face repo, found in its file listing.

Vendors publish NPU and GPU builds as OGA folders: a `genai_config.json` beside the graph, its
external data and `tokenizer.json`. A repo holds one at its root, or one or more in subfolders
(often one per execution provider, e.g. `cpu-int4/`, `npu/`). Only the root and first-level
subfolders count: deeper folders are parts of a model, not models.

Which one a pull takes, and the tag it is stored under:
- `hf.co/ORG/REPO:NAME` names a subfolder (case-insensitive); the tag is its name as published.
  A root folder is named `oga` (the tag it gets), so it can be named beside subfolders.
- without a name: GGUF files win (the behaviour of a GGUF repo does not change because a folder
  sits beside them); else the only folder; else an error listing the choices.
- a name matching no folder goes to the GGUF rules when the repo has GGUF files, else it is an
  error listing the folders.
A subfolder's files are every file under it; the root folder's are the files at the root (its
subfolders may be other models), without dot-files (`.gitattributes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidNameError, ModelNotFoundError
from ..store.model_dirs import OGA_CONFIG_FILE
from ..store.cache import safe_component
from .sources import RemoteFile, gguf_files, remote_file

log = logging.getLogger(__name__)
ROOT_TAG = "oga"


@dataclass(frozen=True)
class RepoFolder:
    repo: str  # ORG/REPO
    path: str  # the folder in the repo; "" for the root
    tag: str  # the tag it is stored under
    files: tuple[tuple[str, RemoteFile], ...]  # (path inside the folder, where it downloads from)

    def describe(self) -> str:
        return f"hf.co/{self.repo}:{self.tag}"


def _files(listing: list[Any]) -> list[str]:
    return [str(item.get("path") or item.get("rfilename") or "") for item in listing
            if isinstance(item, dict) and item.get("type", "file") == "file"]


def oga_folders(listing: list[Any], repo: str, endpoint: str) -> list[RepoFolder]:
    """Every OGA folder of the listing: the root and first-level subfolders holding genai_config.json."""
    paths = _files(listing)
    roots = sorted(p[: -len(OGA_CONFIG_FILE)].rstrip("/") for p in paths
                   if p.rsplit("/", 1)[-1] == OGA_CONFIG_FILE and p.count("/") <= 1)
    items = {str(item.get("path") or item.get("rfilename") or ""): item for item in listing if isinstance(item, dict)}
    folders = []
    for root in roots:
        if root:
            members = [p[len(root) + 1:] for p in paths if p.startswith(root + "/")]
        else:
            members = [p for p in paths if "/" not in p and not p.startswith(".")]
        try:  # every component becomes a path under the store: a folder naming `..` is no model
            for member in members:
                for part in member.split("/"):
                    safe_component(part, "file")
            tag = safe_component(root, "tag") if root else ROOT_TAG
        except InvalidNameError as e:
            log.warning("hf.co/%s: skipping folder %r (%s)", repo, root[:60], e)
            continue
        files = tuple((m, remote_file(items[f"{root}/{m}" if root else m], repo, endpoint)) for m in sorted(members))
        folders.append(RepoFolder(repo, root, tag, files))
    return folders


def choose_folder(listing: list[Any], wanted: str | None, repo: str, endpoint: str) -> RepoFolder | None:
    """The OGA folder a pull of `hf.co/repo[:wanted]` takes, or None when the GGUF rules apply
    (sources.pick_gguf). Raises ModelNotFoundError, with the choices as suggestions, when the repo
    has several folders and no GGUF, a name matching nothing, or neither format at all (the error
    appends the suggestions: "did you mean: hf.co/ORG/REPO:cpu, ...")."""
    folders = oga_folders(listing, repo, endpoint)
    if wanted is not None:
        named = [f for f in folders if f.tag.lower() == wanted.lower()]
        if named:
            return named[0]
    if gguf_files(listing):
        return None
    choices = [f.describe() for f in folders]
    if not folders:
        raise ModelNotFoundError(
            f"hf.co/{repo}",
            message=f"hf.co/{repo} has neither GGUF files nor an onnxruntime-genai folder ({OGA_CONFIG_FILE})")
    if wanted is not None:
        raise ModelNotFoundError(
            f"hf.co/{repo}:{wanted}", choices,
            message=f"hf.co/{repo} has no onnxruntime-genai folder {wanted!r}")
    if len(folders) > 1:
        raise ModelNotFoundError(
            f"hf.co/{repo}", choices,
            message=f"hf.co/{repo} holds {len(folders)} onnxruntime-genai folders; name one")
    return folders[0]
