"""`localserve launch` for opencode, Kilo, Cline, Qwen Code, cn, aider and Mistral Vibe.

Two kinds of agent here, both started by the real `launch` command against one real daemon
(SmolLM2 with 1536 tokens of context and an api_key):

- A fake agent for each: a script on PATH under the agent's command name that records its argv,
  its environment and the run files it was pointed at, so each agent's working form is checked
  as the agent would read it: our daemon's URL, the model, our key (never in argv), the user's own
  config files untouched, the run's files gone afterwards.
- The real agents (npm packages in .test-cache/agents, aider in a venv there). 1536 tokens holds
  the whole prompt of cn (about 880) and aider (593), which answer; opencode's (2632), Kilo's
  (3854), Cline's (1850) and Qwen Code's (9239) do not fit, and each shows our context error:
  proof that it reached us with our model and key, without paying for a prefill SmolLM2 would
  take minutes over on two cores. Mistral Vibe needs Python 3.12 (this venv has 3.11): fake only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_util import cli_env, free_port, register_model, start_serve, stop_quietly, wait_published
from localserve.desktop.agents import AGENTS
from prefetch import aider
from test_launch import installed_agent

API_KEY = "ls-key-5d2e-chat-agents-never-in-argv"
CONTEXT = 1536
MODEL = "smollm2-135m:latest"
NEW_AGENTS = ("opencode", "kilo", "cline", "qwen", "cn", "aider", "vibe")

# What the user already has: launch must neither read these for the provider nor write them.
USER_CONFIGS = {
    ".config/opencode/opencode.json": '{"model": "anthropic/claude-sonnet-4-5"}',
    ".config/kilo/kilo.json": '{"model": "kilo/auto"}',
    ".cline/data/settings/providers.json": '{"version": 1, "lastUsedProvider": "cline", "providers": {}}',
    ".qwen/settings.json": '{"security": {"auth": {"selectedType": "qwen-oauth"}}, "model": {"name": "coder-model"}}',
    ".continue/config.yaml": "name: mine\nversion: 1.0.0\nschema: v1\nmodels: []\n",
    ".aider.conf.yml": "model: gpt-4o\nopenai-api-base: https://gateway.example/v1\n",
    ".env": "AIDER_OPENAI_API_KEY=theirs\nOPENAI_API_KEY=theirs\n",
    ".vibe/config.toml": 'active_model = "devstral"\n',
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path):
    """One daemon for the module; HOME holds the user's own agent configs."""
    root = tmp_path_factory.mktemp("chat-agents")
    for name, text in USER_CONFIGS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = cli_env(root / "localserve", free_port(), LOCALSERVE_CONTEXT_LENGTH=str(CONTEXT),
                  LOCALSERVE_DEFAULT_MAX_TOKENS="64", LOCALSERVE_API_KEY=API_KEY, HOME=str(root),
                  TMPDIR=str(root / "tmp"))
    (root / "tmp").mkdir()
    (root / "work").mkdir()
    register_model(env, smollm2_gguf)
    proc = start_serve(env)
    try:
        wait_published(root / "localserve", proc)
        yield env
    finally:
        stop_quietly(env, proc)


def launch(env: dict[str, str], agent: str, bin_dir: Path, *args: str,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    run_env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "localserve", "launch", agent, "smollm2-135m", "--", *args],
                          env=run_env, cwd=Path(env["HOME"]) / "work", capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def daemon_url(env: dict[str, str]) -> str:
    return f"http://127.0.0.1:{env['LOCALSERVE_PORT']}/v1"


# --- fake agents ---------------------------------------------------------------------------------

FAKE = '''#!{python}
"""A stand-in for the agent: records what it was started with and the run files it could read."""
import json, os, sys
values = [*sys.argv[1:], *os.environ.values()]
folders = {{v.split("/localserve-")[0] + "/localserve-" + v.split("/localserve-")[1].split("/")[0]
            for v in values if "/localserve-" in v}}
files = {{}}
for folder in folders:
    for top, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            files[os.path.relpath(path, folder)] = (open(path).read(), oct(os.stat(path).st_mode & 0o777))
with open(os.environ["FAKE_AGENT_RECORD"], "w") as out:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "files": files, "folders": sorted(folders)}}, out)
'''


def fake_agent(tmp_path: Path, name: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    return bin_dir


def file_json(record: dict, name: str) -> dict:
    return json.loads(record["files"][name][0])


def arg(record: dict, flag: str) -> str:
    return record["argv"][record["argv"].index(flag) + 1]


def _opencode_like(prefix: str):
    def read(record: dict) -> tuple[str, str, str]:
        config = json.loads(record["env"][f"{prefix}_CONFIG_CONTENT"])
        provider = config["provider"]["localserve"]
        assert provider["npm"] == "@ai-sdk/openai-compatible" and "baseURL" not in config  # Kilo reads no top-level one
        assert config["model"] == f"localserve/{MODEL}"
        assert provider["models"][MODEL]["limit"]["context"] == CONTEXT  # listed: offline it knows no other
        return provider["options"]["baseURL"], MODEL, provider["options"]["apiKey"]
    return read


def _cline(record: dict) -> tuple[str, str, str]:
    assert os.path.basename(arg(record, "--data-dir")).startswith("localserve-cline-")
    settings = file_json(record, "settings/providers.json")
    assert settings["lastUsedProvider"] == "openai-compatible"
    chosen = settings["providers"]["openai-compatible"]["settings"]
    return chosen["baseUrl"], chosen["model"], chosen["apiKey"]


def _qwen(record: dict) -> tuple[str, str, str]:
    settings = file_json(record, os.path.basename(record["env"]["QWEN_CODE_SYSTEM_SETTINGS_PATH"]))
    assert settings["security"]["auth"]["selectedType"] == "openai"
    provider = settings["modelProviders"]["openai"][0]
    assert provider["id"] == settings["model"]["name"]
    assert provider["generationConfig"]["contextWindowSize"] == CONTEXT
    return provider["baseUrl"], provider["id"], record["env"][provider["envKey"]]


def _cn(record: dict) -> tuple[str, str, str]:
    model = file_json(record, os.path.basename(arg(record, "--config")))["models"][0]  # JSON is YAML
    assert model["provider"] == "openai" and model["defaultCompletionOptions"]["contextLength"] == CONTEXT
    return model["apiBase"], model["model"], model["apiKey"]


def _aider(record: dict) -> tuple[str, str, str]:
    keys = dict(line.split("=", 1) for line in record["files"]["aider.env"][0].splitlines())
    assert keys["OPENAI_API_KEY"] == keys["AIDER_OPENAI_API_KEY"]
    metadata = file_json(record, os.path.basename(arg(record, "--model-metadata-file")))
    assert metadata[arg(record, "--model")]["max_input_tokens"] == CONTEXT
    assert record["env"]["AIDER_ANALYTICS"] == "false"  # for this run; --analytics-disable would be for good
    return arg(record, "--openai-api-base"), arg(record, "--model").removeprefix("openai/"), keys["OPENAI_API_KEY"]


def _vibe(record: dict) -> tuple[str, str, str]:
    [provider] = json.loads(record["env"]["VIBE_PROVIDERS"])
    [model] = json.loads(record["env"]["VIBE_MODELS"])
    assert record["env"]["VIBE_ACTIVE_MODEL"] == model["alias"] and model["provider"] == provider["name"]
    return provider["api_base"], model["name"], record["env"][provider["api_key_env_var"]]


READ_BACK = {"opencode": _opencode_like("OPENCODE"), "kilo": _opencode_like("KILO"), "cline": _cline,
             "qwen": _qwen, "cn": _cn, "aider": _aider, "vibe": _vibe}


@pytest.mark.parametrize("agent", NEW_AGENTS)
def test_a_fake_agent_reads_the_working_form_for_one_run(daemon: dict[str, str], tmp_path: Path, agent: str) -> None:
    record_path = tmp_path / "record.json"
    env = {**daemon, "FAKE_AGENT_RECORD": str(record_path), "VIBE_PROVIDERS": '[{"name": "theirs"}]',
           "OPENAI_BASE_URL": "https://gateway.example/v1"}
    result = launch(env, agent, fake_agent(tmp_path, agent), "--their-flag")
    assert result.returncode == 0, result.stderr
    record = json.loads(record_path.read_text())
    assert READ_BACK[agent](record) == (daemon_url(daemon), MODEL, API_KEY)
    assert record["argv"][-1] == "--their-flag"  # the user's own arguments come last, unchanged
    # launch's warning where the agent's own prompt does not fit 1536 tokens (Qwen Code's 9239,
    # Vibe's estimated 8200, ...), none where it does (aider's 593, cn's 880)
    assert ("sends about" in result.stderr) == (AGENTS[agent].prompt_tokens >= CONTEXT)
    assert not any(API_KEY in a for a in record["argv"])
    assert all(mode == "0o600" for _text, mode in record["files"].values())
    if agent == "qwen":
        assert record["env"]["OPENAI_BASE_URL"] == daemon_url(daemon)  # theirs dropped
    if agent == "vibe":
        assert "theirs" not in record["env"]["VIBE_PROVIDERS"]
    for folder in record["folders"]:
        assert not os.path.exists(folder)  # the run's files are gone
    home = Path(daemon["HOME"])
    assert {name: (home / name).read_text() for name in USER_CONFIGS} == USER_CONFIGS


# --- the real agents -----------------------------------------------------------------------------


def daemon_log(env: dict[str, str]) -> str:
    return (Path(env["LOCALSERVE_HOME"]) / "logs" / "localserve.log").read_text()


OUR_CONTEXT_ERROR = f"this model's context is {CONTEXT} tokens"


@pytest.mark.parametrize("agent, args", [
    ("opencode", ["run", "Say hello"]),
    ("kilo", ["run", "Say hello"]),
    ("cline", ["--json", "Say hello"]),
    ("qwen", ["-p", "Say hello"]),
])
def test_a_real_agent_whose_prompt_does_not_fit_shows_our_context_error(daemon: dict[str, str], agent: str,
                                                                         args: list[str]) -> None:
    # After our 400 opencode and Kilo would compact and retry (minutes of SmolLM2 summarising):
    # the user's own switch turns that off here.
    env = {**daemon, "OPENCODE_DISABLE_AUTOCOMPACT": "1", "KILO_DISABLE_AUTOCOMPACT": "1"}
    result = launch(env, agent, installed_agent(agent).parent, *args)
    out = result.stdout + result.stderr
    assert "sends about" in result.stderr  # launch's warning first
    assert OUR_CONTEXT_ERROR in out, out  # from the daemon: our URL, our model, our key (else a 401)


def test_real_cn_gets_an_answer_from_the_local_model(daemon: dict[str, str]) -> None:
    """cn's first request is answered (200) with our key. SmolLM2 at times answers cn with a tool
    call, and cn then works on for minutes: the test stops it at its first answer."""
    bin_dir = installed_agent("cn").parent
    run_env = {**daemon, "PATH": f"{bin_dir}{os.pathsep}{daemon['PATH']}"}
    command = [sys.executable, "-m", "localserve", "launch", "cn", "smollm2-135m", "--", "-p", "Say hello"]
    agent = subprocess.Popen(command, env=run_env, cwd=Path(daemon["HOME"]) / "work", stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    answered = '"POST /v1/chat/completions HTTP/1.1" 200'
    seen = len(daemon_log(daemon))  # the module's daemon: only what cn sent counts
    try:
        deadline = time.monotonic() + 240
        while agent.poll() is None and answered not in daemon_log(daemon)[seen:] and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        agent.terminate()
        output = agent.communicate(timeout=30)[0]
    log = daemon_log(daemon)[seen:]
    assert answered in log and '"POST /v1/chat/completions HTTP/1.1" 401' not in log, output


def test_real_aider_answers_from_the_local_model(daemon: dict[str, str]) -> None:
    """The user's ~/.aider.conf.yml names another model and gateway, their ~/.env another key."""
    result = launch(daemon, "aider", aider().parent, "--message", "Say hello", "--no-git", "--yes-always")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"Model: openai/{MODEL}" in out and "Tokens: " in out, out
    assert '"POST /v1/chat/completions HTTP/1.1" 401' not in daemon_log(daemon)
