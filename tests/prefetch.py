"""What the suite downloads besides the model, in one place: the coding agents' npm packages,
Aider's venv and the `openai` npm package the browser test imports, each under `.test-cache`.

A test installs what it needs on first use (under `filling`, so two workers never install one
thing twice). `.ci/run` also runs this file in the background while llama.cpp compiles: the
downloads wait on the network and the compile on the cores, so the test phase finds them in place
instead of holding a test (and its worker) for each install. It needs only the standard library
and npm, because it runs before the venv exists.

    python3 tests/prefetch.py      # everything; a failure is reported and left to the tests
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from worker_locks import filling

CACHE = Path(__file__).resolve().parent.parent / ".test-cache"
AGENTS_DIR = CACHE / "agents"
NPM_DIR = CACHE / "npm"
# The agents as `localserve launch` knows them (localserve.desktop.agents), each at the major the
# tests were written for.
AGENT_PACKAGES = {"copilot": "@github/copilot@1", "codex": "@openai/codex@0", "claude": "@anthropic-ai/claude-code@2",
                  # Kilo 7.8.1's platform binaries are not published; Qwen Code 0.16+ needs Node 22.
                  "opencode": "opencode-ai@1", "kilo": "@kilocode/cli@7.7.7", "cline": "cline@3",
                  "qwen": "@qwen-code/qwen-code@0.15", "cn": "@continuedev/cli@1"}
AIDER = "aider-chat==0.86.2"
OPENAI_JS = "openai@7"  # the major tests/fixtures/browser's page is written for


def _npm_install(prefix: Path, *specs: str) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("needs npm (apt-get install npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", *specs],
                   check=True, timeout=600)


def _package_dir(prefix: Path, spec: str) -> Path:
    """node_modules/@scope/name for "@scope/name@range"."""
    return prefix / "node_modules" / spec[:spec.rindex("@")]


def agent_bin(*names: str) -> Path:
    """The folder of the agents' executables, with each named agent installed (all when none is named)."""
    specs = [AGENT_PACKAGES[name] for name in names or AGENT_PACKAGES]
    with filling("agents"):
        missing = [spec for spec in specs if not (_package_dir(AGENTS_DIR, spec) / "package.json").is_file()]
        if missing:
            _npm_install(AGENTS_DIR, *missing)
    return AGENTS_DIR / "node_modules" / ".bin"


def aider() -> Path:
    """aider's executable, from a venv of its own (its pinned dependencies are not the suite's)."""
    venv = AGENTS_DIR / "aider-venv"
    executable = venv / "bin" / "aider"
    with filling("agents"):
        if not executable.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", AIDER],
                           check=True, timeout=1200)
    return executable


def openai_js() -> Path:
    """node_modules/openai at OPENAI_JS's major."""
    package = _package_dir(NPM_DIR, OPENAI_JS)
    manifest = package / "package.json"
    major = OPENAI_JS.split("@")[1]
    with filling("npm"):
        if not (manifest.exists() and json.loads(manifest.read_text())["version"].split(".")[0] == major):
            _npm_install(NPM_DIR, OPENAI_JS)
    return package


def main() -> int:
    failed = []
    for name, fetch in (("agents", agent_bin), ("aider", aider), ("openai npm package", openai_js)):
        try:
            fetch()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            print(f"prefetch: {name}: {exc}", file=sys.stderr)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
