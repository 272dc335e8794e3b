"""The agents that speak Chat Completions to an OpenAI-compatible provider they read from their
own configuration: opencode, Kilo, Cline, Qwen Code, Continue's `cn`, aider and Mistral Vibe.

Each gets, for one run, the configuration layer of its own that outranks the user's files (read
from the agent's source or binary, checked with the versions named), so the user's own
configuration is neither read for the provider nor written:

- opencode and Kilo (Kilo's CLI is an opencode fork) merge their config files under an inline
  config in OPENCODE_CONFIG_CONTENT / KILO_CONFIG_CONTENT, the highest layer a user writes. The
  provider's address goes in `provider.<id>.options.baseURL` (Kilo ignores a top-level `baseURL`),
  and the model is listed under the provider: offline, neither knows a model it has not been told
  of (the models.dev catalogue is not reachable, and is not fetched).
- Cline 3 keeps its providers in DATA_DIR/settings/providers.json. `cline auth -p ollama -b URL`
  is refused (it wants a key) and `auth` would put our key in argv, so launch writes that file
  into the run's folder and points `--data-dir` at it: the run's history stays there too.
- Qwen Code reads a system settings file, which outranks user and project settings, from
  QWEN_CODE_SYSTEM_SETTINGS_PATH; a `modelProviders` entry there outranks --model, OPENAI_* and
  the user's `security.auth`.
- `cn` reads one YAML config given by `--config` (JSON is YAML).
- aider: address and model on its command line (which outranks its .aider.conf.yml and the
  environment); the key in an env file given by `--env-file`, loaded last and over the
  user's .env files, since a .env in HOME, the repo or the cwd would overwrite a plain variable.
- Mistral Vibe reads VIBE_* variables over its config.toml (pydantic settings), and a variable
  set in the process over its ~/.vibe/.env.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .agent_base import TOKEN_VAR, Agent, Target

PROVIDER = "localserve"  # the provider id (and Vibe's model alias) each config names

# Agents that would otherwise phone home at start: update checks, model catalogues.
# Their default plugins are the cloud providers' login helpers, fetched from a package registry at
# start: offline, each waits out its timeout before the first request.
OPENCODE_QUIET = ("DISABLE_AUTOUPDATE", "DISABLE_MODELS_FETCH", "DISABLE_DEFAULT_PLUGINS")


def answer_budget(t: Target) -> int:
    """Tokens of answer an agent may ask for: a quarter of the context, the rest is its prompt."""
    return max(256, t.context // 4)


def _opencode_config(t: Target) -> dict[str, Any]:
    model = {"name": t.model, "tool_call": True, "limit": {"context": t.context, "output": answer_budget(t)}}
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "localserve",
                "options": {"baseURL": t.openai_url, "apiKey": t.token}, "models": {t.model: model}}
    chosen = f"{PROVIDER}/{t.model}"
    return {"provider": {PROVIDER: provider}, "model": chosen, "small_model": chosen}


def _opencode_like(prefix: str) -> Callable[[Target], dict[str, str]]:
    def environment(t: Target) -> dict[str, str]:
        return {f"{prefix}_CONFIG_CONTENT": json.dumps(_opencode_config(t)),
                **{f"{prefix}_{switch}": "1" for switch in OPENCODE_QUIET}}
    return environment


CLINE_PROVIDER = "openai-compatible"


def _cline_providers(t: Target) -> dict[str, Any]:
    settings = {"provider": CLINE_PROVIDER, "apiKey": t.token, "model": t.model, "baseUrl": t.openai_url}
    return {"version": 1, "lastUsedProvider": CLINE_PROVIDER, "modes": {},
            # Without `updatedAt` Cline takes the file for invalid and writes its own default over it.
            "providers": {CLINE_PROVIDER: {"settings": settings, "updatedAt": "2026-01-01T00:00:00.000Z",
                                           "tokenSource": "manual"}}}


CLINE_PROVIDERS_FILE = "settings/providers.json"


def _cline_arguments(t: Target) -> list[str]:
    return ["--data-dir", t.workdir]


QWEN_SETTINGS = "qwen-system-settings.json"


def _qwen_settings(t: Target) -> dict[str, Any]:
    provider = {"id": t.model, "name": t.model, "baseUrl": t.openai_url, "envKey": TOKEN_VAR,
                "generationConfig": {"contextWindowSize": t.context}}
    return {"security": {"auth": {"selectedType": "openai"}}, "model": {"name": t.model},
            "modelProviders": {"openai": [provider]}}


def _qwen_environment(t: Target) -> dict[str, str]:
    return {"QWEN_CODE_SYSTEM_SETTINGS_PATH": t.path(QWEN_SETTINGS), TOKEN_VAR: t.token,
            "OPENAI_API_KEY": t.token, "OPENAI_BASE_URL": t.openai_url, "OPENAI_MODEL": t.model}


CN_CONFIG = "cn-config.yaml"


def _cn_config(t: Target) -> dict[str, Any]:
    model = {"name": t.model, "provider": "openai", "model": t.model, "apiBase": t.openai_url, "apiKey": t.token,
             "roles": ["chat", "edit", "apply"],
             "defaultCompletionOptions": {"contextLength": t.context, "maxTokens": answer_budget(t)}}
    return {"name": "localserve", "version": "1.0.0", "schema": "v1", "models": [model]}


AIDER_ENV = "aider.env"
AIDER_METADATA = "aider-model-metadata.json"


def _aider_model(t: Target) -> str:
    return f"openai/{t.model}"  # litellm's OpenAI-compatible route, to OPENAI_API_BASE


def _aider_arguments(t: Target) -> list[str]:
    return ["--model", _aider_model(t), "--weak-model", _aider_model(t), "--openai-api-base", t.openai_url,
            "--model-metadata-file", t.path(AIDER_METADATA), "--env-file", t.path(AIDER_ENV)]


def _aider_files(t: Target) -> dict[str, str]:
    metadata = {_aider_model(t): {"max_input_tokens": t.context, "max_output_tokens": answer_budget(t),
                                  "max_tokens": answer_budget(t), "input_cost_per_token": 0.0,
                                  "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}
    keys = f"AIDER_OPENAI_API_KEY={t.token}\nOPENAI_API_KEY={t.token}\n"
    return {AIDER_ENV: keys, AIDER_METADATA: json.dumps(metadata)}


def _vibe_environment(t: Target) -> dict[str, str]:
    provider = {"name": PROVIDER, "api_base": t.openai_url, "api_key_env_var": TOKEN_VAR, "api_style": "openai"}
    model = {"name": t.model, "provider": PROVIDER, "alias": PROVIDER, "auto_compact_threshold": t.context * 3 // 4}
    return {"VIBE_PROVIDERS": json.dumps([provider]), "VIBE_MODELS": json.dumps([model]),
            "VIBE_ACTIVE_MODEL": PROVIDER, TOKEN_VAR: t.token}


def _json_file(name: str, build: Callable[[Target], dict[str, Any]]) -> Callable[[Target], dict[str, str]]:
    return lambda t: {name: json.dumps(build(t))}


CHAT_AGENTS = (
    Agent("opencode", "opencode", "opencode", "npm install -g opencode-ai",
          prompt_tokens=2632, measured_with="measured with 1.18.33",
          environment=_opencode_like("OPENCODE")),
    Agent("kilo", "Kilo CLI", "kilo", "npm install -g @kilocode/cli",
          prompt_tokens=3854, measured_with="measured with 7.7.7",
          environment=_opencode_like("KILO")),
    Agent("cline", "Cline CLI", "cline", "npm install -g cline",
          prompt_tokens=1850, measured_with="measured with 3.0.65",
          arguments=_cline_arguments, files=_json_file(CLINE_PROVIDERS_FILE, _cline_providers)),
    Agent("qwen", "Qwen Code", "qwen", "npm install -g @qwen-code/qwen-code",
          prompt_tokens=9239, measured_with="measured with 0.15.10",
          environment=_qwen_environment, files=_json_file(QWEN_SETTINGS, _qwen_settings),
          owned_prefixes=("OPENAI_",)),
    Agent("cn", "Continue CLI (cn)", "cn", "npm install -g @continuedev/cli",
          prompt_tokens=880, measured_with="measured with 1.5.47 (its own count: it checks before sending)",
          arguments=lambda t: ["--config", t.path(CN_CONFIG)], files=_json_file(CN_CONFIG, _cn_config)),
    Agent("aider", "aider", "aider", "python -m pip install aider-chat",
          prompt_tokens=593, measured_with="measured with 0.86.2",
          environment=lambda t: {"AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS": "false"},
          arguments=_aider_arguments, files=_aider_files),
    Agent("vibe", "Mistral Vibe", "vibe", "uv tool install mistral-vibe",
          prompt_tokens=8200, measured_with="an estimate: mistral-vibe 2.18.4's system and tool prompts are 7,174 "
                                            "tokens before their schemas; it was not run here",
          environment=_vibe_environment, owned_prefixes=("VIBE_PROVIDERS", "VIBE_MODELS", "VIBE_ACTIVE_MODEL")),
)
