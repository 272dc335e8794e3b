"""Another local account reads nothing of a user's prompts, answers or logs (security review 4, #2).

The review's attack, on a real daemon: the victim's data home sits in a 0755 folder (what Debian's
`useradd -m` makes), the daemon stores a response and a batch file holding secrets and logs as
usual, and a second account walks the home looking for anything it can read. Files left 0644 by an
older version are repaired when the daemon starts. The second account is the `nobody` uid, entered
with setpriv, so the test needs root (CI runs as root) and creates no account.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from localserve.config.private import private_places
from localserve.config.settings import Settings

from daemon_util import attacked_daemon, http_post

NOBODY = 65534
SECRET = "My bank PIN is 4242-VICTIM-SECRET"
BATCH_SECRET = "BATCH-VICTIM-SECRET"
OLD_SECRET = "OLD-INSTALL-SECRET"

needs_a_second_account = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second local account")


def as_other_account(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def open_home() -> Iterator[Path]:
    """A data home inside folders any account may traverse, as `useradd -m` leaves a home here."""
    base = Path(tempfile.mkdtemp(prefix="ls-private-"))
    try:
        base.chmod(0o755)
        home = base / "home"
        home.mkdir(mode=0o755)
        home.chmod(0o755)
        yield home
    finally:
        shutil.rmtree(base, ignore_errors=True)


def plant_an_older_install(home: Path) -> list[Path]:
    """What a version before this fix left: world-readable files in world-traversable folders."""
    planted = []
    for relative in ("batches/files/file-old", "logs/localserve.log.1", "responses/old-export.json"):
        path = home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o755)
        path.write_text(OLD_SECRET)
        path.chmod(0o644)
        planted.append(path)
    return planted


@needs_a_second_account
def test_a_second_account_reads_nothing_the_daemon_keeps(open_home: Path, smollm2_gguf: Path) -> None:
    planted = plant_an_older_install(open_home)
    with attacked_daemon(open_home, smollm2_gguf) as (info, _proc):
        url = info["url"]
        status, body = http_post(url + "/v1/responses", {"model": "smol", "input": SECRET, "max_output_tokens": 2})
        assert status == 200, body
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused")
        line = ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smol", '
                f'"messages": [{{"role": "user", "content": "{BATCH_SECRET}"}}]}}}}\n')
        client.files.create(file=("in.jsonl", io.BytesIO(line.encode())), purpose="batch")

        settings = Settings(home=open_home, sources={"home": "env"})
        places = private_places(settings)
        # The review's read: every file of the home, as the other account.
        seen = as_other_account("find", str(open_home), "-type", "f", "-readable")
        readable = [Path(p) for p in seen.stdout.splitlines()]
        leaked = [p for p in readable if any(p.is_relative_to(place) for place in places)]
        assert leaked == [], f"another account can read {leaked}"
        for path in readable:  # whatever it may read (model files) holds no secret
            text = path.read_bytes()
            assert SECRET.encode() not in text and BATCH_SECRET.encode() not in text, path
        for path in planted:
            assert as_other_account("cat", str(path)).returncode != 0, path

        # Every file and folder of those places is the owner's alone, new and repaired alike.
        checked = 0
        for place in places:
            for path in [place, *place.rglob("*")]:
                mode = stat.S_IMODE(path.lstat().st_mode)
                assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
                checked += 1
        assert checked > 8  # the stores, the log and the run files were there to check
        assert (settings.responses_dir / "responses.sqlite3").exists()
        assert (settings.log_dir / "localserve.log").exists()


def test_the_repair_never_follows_a_planted_link(tmp_path: Path) -> None:
    """A link inside a private folder to a file elsewhere (another program's, or /etc's): the
    repair tightens the folder and leaves what the link points at as it was."""
    from localserve.config.private import make_private

    settings = Settings(home=tmp_path / "home", sources={"home": "env"})
    outside = tmp_path / "shared.txt"
    outside.write_text("not ours to change")
    outside.chmod(0o644)
    settings.responses_dir.mkdir(parents=True)
    settings.responses_dir.chmod(0o755)
    (settings.responses_dir / "link").symlink_to(outside)
    before = os.umask(0o022)
    try:
        changed = make_private(settings)
    finally:
        os.umask(before)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    assert stat.S_IMODE(settings.responses_dir.stat().st_mode) == 0o700
    assert changed == [settings.responses_dir]
