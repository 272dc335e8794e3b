"""The coding agents `localserve launch` starts against the daemon: what each one needs to talk to us.

Each agent is pointed at localhost by its own documented switches, read from the agent itself
(`copilot help providers`, `codex --help`, the variables Claude Code's binary reads), never by
editing the user's config files: a launch changes that one run of the agent and nothing else, and
the same agent started by hand still talks to its own cloud.

- Claude Code speaks Anthropic's Messages API: ANTHROPIC_BASE_URL, a non-empty token, and every
  model tier (opus, sonnet, haiku, subagents) set to the one local model, since it otherwise names
  `claude-*` models for background work that no local cache holds. Claude Code applies the `env`
  of its settings files over its own environment (user, project, local, then its command-line
  layer, then managed settings: a user's `~/.claude/settings.json` naming a company gateway won
  over our environment and got the session and our key, issue 49 #6). So the same variables also
  go in its command-line layer (`--settings FILE`, which outranks every file a user edits; checked
  with 2.1.197), and a managed settings file that sets one of them, the only layer above it, is
  refused before the agent starts (`claude_managed_overrides`).
- Codex CLI speaks the Responses API: a model provider given by `-c` overrides (which Codex parses
  as TOML) with `wire_api = "responses"`, its key read from an environment variable of ours. The
  overrides win over `~/.codex/config.toml` (its own `model_provider`, checked with 0.171.0).
- Copilot CLI takes a provider from COPILOT_PROVIDER_* and nowhere else (its config.json has no
  provider; a `model` saved there does not beat COPILOT_MODEL, checked with 1.0.102). Some of the
  user's own COPILOT_PROVIDER_* would win over ours (BEARER_TOKEN and API_KEY_COMMAND over the
  key, WIRE_MODEL over the model, HEADERS added), so every inherited one is dropped. Its default
  wire format is Chat Completions, the dialect we have served longest, so that is what it gets.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

# The variable Codex reads the token from (its provider's `env_key`). Not LOCALSERVE_API_KEY: that
# one is our own setting, and a `localserve` command the agent runs would take it as such.
CODEX_TOKEN_VAR = "LOCALSERVE_AGENT_TOKEN"
NO_KEY_TOKEN = "localserve"  # agents refuse an empty token; the daemon ignores it without api_key


@dataclass(frozen=True)
class Target:
    """Where the agent is sent: the daemon, the token it checks, the model and its served context."""

    base_url: str  # http://127.0.0.1:PORT, no trailing slash
    token: str
    model: str
    context: int  # tokens of prompt and answer each request gets (/api/show's context_length)


@dataclass(frozen=True)
class Agent:
    name: str  # what `localserve launch NAME` takes
    title: str
    executable: str
    install: str  # the command that installs it, for the message when it is missing
    # The prompt the agent sends before the user's first word (its system prompt and tool
    # schemas), measured with the version named, in SmolLM2's tokens: with a smaller served
    # context every request is refused, so launch says so before starting the agent.
    prompt_tokens: int
    measured_with: str
    environment: Callable[[Target], dict[str, str]]
    arguments: Callable[[Target], list[str]]
    # Inherited variables that name the agent's provider: dropped, so only ours name it.
    owned_prefixes: tuple[str, ...] = ()
    # What goes in the agent's own settings layer that outranks the user's files (Claude Code's
    # `--settings FILE`), written by launch to a private file for the run; None for the others.
    settings: Callable[[Target], dict[str, Any]] | None = None
    settings_flag: str = ""
    # `where: what` for each setting of the agent's that outranks every switch of ours.
    overrides: Callable[[], list[str]] = list

    def command(self, executable: str, target: Target, extra: Sequence[str],
                settings_file: str | None = None) -> list[str]:
        settings = [self.settings_flag, settings_file] if settings_file else []
        return [executable, *settings, *self.arguments(target), *extra]

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


# Claude Code's switches to a cloud provider (2.1.197's getAPIProvider): any one set by a settings
# file sends the session there, past ANTHROPIC_BASE_URL. An empty value is off.
CLAUDE_PROVIDER_SWITCHES = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY",
                            "CLAUDE_CODE_USE_ANTHROPIC_AWS", "CLAUDE_CODE_USE_MANTLE", "CLAUDE_CODE_USE_GATEWAY")
# What a managed settings file may not set for a launch to go ahead: where requests go and what
# authenticates them. The rest of our variables only tune the session.
CLAUDE_ROUTING = ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_API_KEY", *CLAUDE_PROVIDER_SWITCHES)


def _claude_environment(t: Target) -> dict[str, str]:
    tiers = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
             "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
    return {
        "ANTHROPIC_BASE_URL": t.base_url,
        "ANTHROPIC_AUTH_TOKEN": t.token,
        "ANTHROPIC_API_KEY": "",  # a user's real key would otherwise be sent to us, and win over the token
        **{name: "" for name in CLAUDE_PROVIDER_SWITCHES},
        **{name: t.model for name in tiers},
        # Compact before the served context runs out (Claude Code assumes its models' 200k). It
        # takes no window under 100k (2.1.197), so a smaller context still overflows first.
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context),
        # The per-request billing header changes the system prompt's first block on every call,
        # which would defeat our prefix cache; the daemon normalises it too, for hand-made setups.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        # No telemetry or update checks to Anthropic for a session that runs on a local model.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def _claude_settings(t: Target) -> dict[str, Any]:
    """Claude Code's command-line settings layer: the same variables, where a user's settings
    file cannot override them. It holds the token (a user's env.ANTHROPIC_AUTH_TOKEN would win
    over ours otherwise), so launch writes it to a 0600 file, never to argv."""
    return {"env": _claude_environment(t)}


def claude_managed_dir() -> Path:
    """Where Claude Code reads managed (enterprise) settings, the one layer above `--settings`."""
    if sys.platform == "darwin":
        return Path("/Library/Application Support/ClaudeCode")
    if sys.platform == "win32":
        return Path(r"C:\Program Files\ClaudeCode")
    return Path("/etc/claude-code")


def claude_managed_overrides(directory: Path | None = None) -> list[str]:
    """`file: env.NAME` for each routing variable a managed settings file sets, which Claude Code
    would apply over ours: managed-settings.json, then managed-settings.d/*.json as Claude Code
    reads them. MDM profiles and server-delivered managed settings are not files we can read."""
    directory = directory or claude_managed_dir()
    drop_in = directory / "managed-settings.d"
    files = [directory / "managed-settings.json"]
    if drop_in.is_dir():
        files += sorted(p for p in drop_in.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
    found = []
    for path in files:
        try:
            env = json.loads(path.read_text(encoding="utf-8")).get("env") or {}
        except (OSError, ValueError, AttributeError):
            continue  # absent, unreadable or not an object: Claude Code ignores it as well
        found += [f"{path}: env.{name}" for name in CLAUDE_ROUTING if name in env]
    return found


def _codex_arguments(t: Target) -> list[str]:
    provider = {
        "name": "localserve",
        "base_url": f"{t.base_url}/v1",
        "wire_api": "responses",
        "env_key": CODEX_TOKEN_VAR,
    }
    overrides = ['model_provider="localserve"', f'model="{t.model}"', f"model_context_window={t.context}"]
    overrides += [f'model_providers.localserve.{key}="{value}"' for key, value in provider.items()]
    return [arg for override in overrides for arg in ("-c", override)]


def _copilot_environment(t: Target) -> dict[str, str]:
    return {
        "COPILOT_PROVIDER_BASE_URL": f"{t.base_url}/v1",
        "COPILOT_PROVIDER_TYPE": "openai",
        "COPILOT_PROVIDER_WIRE_API": "completions",
        "COPILOT_PROVIDER_API_KEY": t.token,
        "COPILOT_MODEL": t.model,
        # Copilot sizes its history by these; unset, it assumes a cloud model's 128k.
        "COPILOT_PROVIDER_MAX_PROMPT_TOKENS": str(t.context * 3 // 4),
        "COPILOT_PROVIDER_MAX_OUTPUT_TOKENS": str(t.context // 4),
    }


AGENTS: dict[str, Agent] = {
    agent.name: agent
    for agent in (
        Agent("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code",
              prompt_tokens=20249, measured_with="2.1.197",
              environment=_claude_environment, arguments=lambda t: [],
              settings=_claude_settings, settings_flag="--settings", overrides=claude_managed_overrides),
        Agent("codex", "Codex CLI", "codex", "npm install -g @openai/codex",
              prompt_tokens=9127, measured_with="0.171.0",
              environment=lambda t: {CODEX_TOKEN_VAR: t.token}, arguments=_codex_arguments),
        Agent("copilot", "Copilot CLI", "copilot", "npm install -g @github/copilot",
              prompt_tokens=12275, measured_with="1.0.102",
              environment=_copilot_environment, arguments=lambda t: [],
              owned_prefixes=("COPILOT_PROVIDER_",)),
    )
}


def context_warning(agent: Agent, target: Target) -> str | None:
    """A line for the user when the agent's own prompt will not fit the model's served context."""
    if not agent.prompt_tokens or target.context > agent.prompt_tokens:
        return None
    return (f"{agent.title} sends about {agent.prompt_tokens} tokens before your first message "
            f"(measured with {agent.measured_with}); {target.model} is served with {target.context}, "
            "so it will refuse to start or every request will be. Raise the context_length setting "
            "(LOCALSERVE_CONTEXT_LENGTH; at most the model's trained context) or pick a model with a "
            "longer context.")
