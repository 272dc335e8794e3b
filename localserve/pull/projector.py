"""The projector a Hub repo publishes beside its GGUF model (`mmproj-*.gguf`), pulled with the model
into the same tag (store/projector.py says what a projector is and how the manifest records it).

Fetched like the model itself, through the pull job's download (resumable `.partial`, the same
transport, policy and cancellation), checked against the sha256 the listing publishes and as a
projector GGUF, then renamed into the tag's folder before the manifest names it. A repo without a
projector pulls as before; a repo whose projector fails to download fails the pull, as a model file
would: a vision model without its projector would load and then refuse every image.
"""

from __future__ import annotations

from typing import Any

from ..errors import GGUFError
from ..protocol.progress import emit
from ..store.cache import safe_component
from ..store.projector import check_projector, pick_projector
from .sources import remote_file


def pull_projector(job: Any, repo: str, listing: list[dict[str, Any]], wanted: str | None) -> dict[str, Any] | None:
    """The manifest entry of `repo`'s projector, fetched and verified into the folder of `job` (the
    puller's _Job, whose download, digest check and promotion it reuses; not imported: puller
    imports this module); None when the listing has none (or the catalog says "none")."""
    if wanted == "none":
        return None
    by_path = {str(item.get("path") or item.get("rfilename") or ""): item for item in listing
               if isinstance(item, dict) and item.get("type", "file") == "file"}
    chosen = pick_projector(list(by_path), wanted)
    if chosen is None:
        if wanted:
            raise GGUFError(f"hf.co/{repo} has no projector file {wanted!r}")
        return None
    remote = remote_file(by_path[chosen], repo, job.settings.hf_endpoint)
    file_name = safe_component(remote.file_name, "file")
    target = job.directory / file_name
    partial = job.directory / f"{file_name}.partial"
    emit(job.progress, f"pulling the vision projector {file_name}")
    sha = job.reuse_orphan(target, remote.sha256, remote.git_oid)
    if sha is None:
        job.download(remote.url, partial, remote.sha256, remote.size, file_name)

        def check(path: Any) -> str:
            digest = job.check_digest(path, file_name, remote.sha256, git_oid=remote.git_oid)
            try:
                check_projector(path, file_name)
            except GGUFError:
                path.unlink(missing_ok=True)
                raise
            return digest

        sha = job.promote(partial, target, check)
    return {"file": file_name, "size": target.stat().st_size, "sha256": sha, "url": remote.url}
