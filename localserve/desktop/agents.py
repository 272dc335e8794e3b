"""The coding agents `localserve launch` starts against the daemon: what each one needs to talk to us.

Claude Code, Codex and Copilot are here; the seven that read an OpenAI-compatible provider from
their own config (opencode, Kilo, Cline, Qwen Code, cn, aider, Mistral Vibe) are in chat_agents.py,
and what all of them are made of (`Agent`, `Target`) in agent_base.py.

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
import sys
from pathlib import Path
from typing import Any

from .agent_base import NO_KEY_TOKEN, TOKEN_VAR, Agent, Target
from .chat_agents import CHAT_AGENTS

__all__ = ["AGENTS", "NO_KEY_TOKEN", "Agent", "Target", "context_warning"]

CODEX_TOKEN_VAR = TOKEN_VAR  # Codex reads the token from the variable its provider's `env_key` names


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
    over ours otherwise), so launch writes it to the run's 0600 file, never to argv."""
    return {"env": _claude_environment(t)}


CLAUDE_SETTINGS = "settings.json"


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
        "base_url": t.openai_url,
        "wire_api": "responses",
        "env_key": CODEX_TOKEN_VAR,
    }
    overrides = ['model_provider="localserve"', f'model="{t.model}"', f"model_context_window={t.context}"]
    overrides += [f'model_providers.localserve.{key}="{value}"' for key, value in provider.items()]
    return [arg for override in overrides for arg in ("-c", override)]


def _copilot_environment(t: Target) -> dict[str, str]:
    return {
        "COPILOT_PROVIDER_BASE_URL": t.openai_url,
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
              prompt_tokens=20249, measured_with="measured with 2.1.197",
              environment=_claude_environment, arguments=lambda t: ["--settings", t.path(CLAUDE_SETTINGS)],
              files=lambda t: {CLAUDE_SETTINGS: json.dumps(_claude_settings(t))}, overrides=claude_managed_overrides),
        Agent("codex", "Codex CLI", "codex", "npm install -g @openai/codex",
              prompt_tokens=9127, measured_with="measured with 0.171.0",
              environment=lambda t: {CODEX_TOKEN_VAR: t.token}, arguments=_codex_arguments),
        Agent("copilot", "Copilot CLI", "copilot", "npm install -g @github/copilot",
              prompt_tokens=12275, measured_with="measured with 1.0.102",
              environment=_copilot_environment, owned_prefixes=("COPILOT_PROVIDER_",)),
        *CHAT_AGENTS,
    )
}


def context_warning(agent: Agent, target: Target) -> str | None:
    """A line for the user when the agent's own prompt will not fit the model's served context."""
    if not agent.prompt_tokens or target.context > agent.prompt_tokens:
        return None
    return (f"{agent.title} sends about {agent.prompt_tokens} tokens before your first message "
            f"({agent.measured_with}); {target.model} is served with {target.context}, "
            "so it will refuse to start or every request will be. Raise the context_length setting "
            "(LOCALSERVE_CONTEXT_LENGTH; at most the model's trained context) or pick a model with a "
            "longer context.")
