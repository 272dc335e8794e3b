"""What `localserve launch` knows of a coding agent: where it is sent (`Target`) and how (`Agent`).

An agent is pointed at the daemon for one run only: by its environment, its arguments and, where
it reads its provider from a file, files written to a private folder made for the run (0700,
removed when the agent exits), never by editing the user's own configuration.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

# The variable an agent reads the daemon's token from where its config names a variable rather
# than a value. Not LOCALSERVE_API_KEY: that one is our own setting, and a `localserve` command
# the agent runs would take it as such.
TOKEN_VAR = "LOCALSERVE_AGENT_TOKEN"
NO_KEY_TOKEN = "localserve"  # agents refuse an empty token; the daemon ignores it without api_key


@dataclass(frozen=True)
class Target:
    """Where the agent is sent: the daemon, the token it checks, the model and its served context."""

    base_url: str  # http://127.0.0.1:PORT, no trailing slash
    token: str
    model: str
    context: int  # tokens of prompt and answer each request gets (/api/show's context_length)
    workdir: str = ""  # the run's private folder holding the agent's `files`; "" before it exists

    def path(self, name: str) -> str:
        """Where one of the agent's `files` lies for this run."""
        return os.path.join(self.workdir, name)

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"


def _nothing(_target: Target) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Agent:
    name: str  # what `localserve launch NAME` takes
    title: str
    executable: str
    install: str  # the command that installs it, for the message when it is missing
    # The prompt the agent sends before the user's first word (its system prompt and tool
    # schemas) in SmolLM2's tokens: with a smaller served context every request is refused, so
    # launch says so before starting the agent. `measured_with` names the version it was
    # measured with, or says how it was estimated where the agent could not be run here.
    prompt_tokens: int
    measured_with: str
    environment: Callable[[Target], dict[str, str]] = _nothing
    arguments: Callable[[Target], list[str]] = lambda t: []
    # Files the agent reads for this run (name -> text), written 0600 to the run's folder;
    # `environment` and `arguments` name them with `target.path(name)`. They hold the token.
    files: Callable[[Target], dict[str, str]] | None = None
    # Inherited variables that name the agent's provider: dropped, so only ours name it.
    owned_prefixes: tuple[str, ...] = ()
    # `where: what` for each setting of the agent's that outranks every switch of ours.
    overrides: Callable[[], list[str]] = list

    def command(self, executable: str, target: Target, extra: Sequence[str]) -> list[str]:
        return [executable, *self.arguments(target), *extra]

    def environ(self, target: Target, inherited: Mapping[str, str]) -> dict[str, str]:
        """The agent's whole environment: the user's, less what names a provider, plus ours."""
        kept = {k: v for k, v in inherited.items() if not (self.owned_prefixes and k.startswith(self.owned_prefixes))}
        return {**kept, **self.environment(target)}

    def find(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The agent's executable on PATH (or, for Claude Code, its own per-user install)."""
        path = (environ if environ is not None else os.environ).get("PATH")
        found = shutil.which(self.executable, path=path)
        if found:
            return found
        if self.name == "claude":
            # Claude Code's own installer puts it here without touching PATH.
            local = Path.home() / ".claude" / "local" / ("claude.exe" if sys.platform == "win32" else "claude")
            if local.is_file():
                return str(local)
        return None
