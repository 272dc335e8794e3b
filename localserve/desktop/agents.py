"""The coding agents `localserve launch` starts against the daemon: what each one needs to talk to us.

Each agent is pointed at localhost by its own documented switches, read from the agent itself
(`copilot help providers`, `codex --help`, the variables Claude Code's binary reads), never by
editing the user's config files: a launch changes that one run of the agent and nothing else, and
the same agent started by hand still talks to its own cloud.

- Claude Code speaks Anthropic's Messages API: ANTHROPIC_BASE_URL, a non-empty token, and every
  model tier (opus, sonnet, haiku, subagents) set to the one local model, since it otherwise names
  `claude-*` models for background work that no local cache holds.
- Codex CLI speaks the Responses API: a model provider given by `-c` overrides (which Codex parses
  as TOML) with `wire_api = "responses"`, its key read from an environment variable of ours.
- Copilot CLI takes a provider from COPILOT_PROVIDER_*; its default wire format is Chat
  Completions, the dialect we have served longest, so that is what it gets.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

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

    def command(self, executable: str, target: Target, extra: Sequence[str]) -> list[str]:
        return [executable, *self.arguments(target), *extra]

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


def _claude_environment(t: Target) -> dict[str, str]:
    tiers = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
             "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
    return {
        "ANTHROPIC_BASE_URL": t.base_url,
        "ANTHROPIC_AUTH_TOKEN": t.token,
        "ANTHROPIC_API_KEY": "",  # a user's real key would otherwise be sent to us, and win over the token
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
              environment=_claude_environment, arguments=lambda t: []),
        Agent("codex", "Codex CLI", "codex", "npm install -g @openai/codex",
              prompt_tokens=9127, measured_with="0.171.0",
              environment=lambda t: {CODEX_TOKEN_VAR: t.token}, arguments=_codex_arguments),
        Agent("copilot", "Copilot CLI", "copilot", "npm install -g @github/copilot",
              prompt_tokens=12275, measured_with="1.0.102",
              environment=_copilot_environment, arguments=lambda t: []),
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
