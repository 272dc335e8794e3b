"""What holds a user's prompts and answers is readable by that user alone.

The stored responses (and their SQLite WAL, which holds recent conversations in clear), the Batch
API's input and output files and database, the logs and the daemon's run files used to be created
with the process umask: 0644 files in 0755 folders. Wherever the data home is traversable by other
accounts -- Debian's `useradd` makes homes 0755, Ubuntu did before 21.04, and an installer may put
LOCALSERVE_HOME on a shared disk -- a second local account read a planted secret straight out of
`responses.sqlite3-wal` and a batch file (security review, round 4).

So the daemon starts with umask 077, which every file it and its engine workers create then
inherits (models, stores, logs, the prompt cache), and repairs what an older version left behind in
the places below: folders 0700, files 0600. The model cache's existing files are left as they are:
weights are no secret, and a model folder shared on purpose stays shared. The prompt cache on disk
(store/prompt_cache.py) is one of those places: its files are conversations' KV cells.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from .settings import Settings

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_places(settings: Settings) -> list[Path]:
    """The folders whose contents hold prompts, answers or the daemon's own state."""
    return [settings.responses_dir, settings.batches_dir, settings.prompt_cache_dir, settings.log_dir,
            settings.run_dir]


def make_private(settings: Settings) -> list[Path]:
    """Set the process umask for the daemon's life and tighten what exists already; returns the
    paths whose modes it changed (for one log line)."""
    if sys.platform == "win32":  # per-user ACLs of the profile folder already keep others out
        return []
    os.umask(PRIVATE_UMASK)
    changed: list[Path] = []
    for place in private_places(settings):
        changed += _tighten_tree(place)
    return changed


def private_dir(path: Path) -> Path:
    """`path` made (with its parents) as a user-only folder, tightened if it existed."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if sys.platform != "win32":
        _tighten(path, DIR_MODE)
    return path


def _tighten_tree(root: Path) -> list[Path]:
    if not root.is_dir() or root.is_symlink():
        return []
    changed = [root] if _tighten(root, DIR_MODE) else []
    # followlinks=False and the is_symlink checks: a link planted in the tree must not make us chmod
    # whatever it points at.
    for folder, dirs, files in os.walk(root, followlinks=False):
        base = Path(folder)
        for name in dirs:
            if _tighten(base / name, DIR_MODE):
                changed.append(base / name)
        for name in files:
            if _tighten(base / name, FILE_MODE):
                changed.append(base / name)
    return changed


def _tighten(path: Path, mode: int) -> bool:
    """Drop the group's and others' bits of `path` (never a link's target); whether it changed."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            return False  # not ours to change (a file another account put there stays as it is)
        current = stat.S_IMODE(st.st_mode)
        wanted = current & mode
        if current == wanted:
            return False
        os.chmod(path, wanted)
        return True
    except OSError:  # gone meanwhile, or a file system without modes: nothing to tighten
        return False
