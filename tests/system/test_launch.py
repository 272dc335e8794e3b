"""`localserve launch`: the switches each coding agent gets, and the real agents started with them.

The agents are the real npm packages (Copilot CLI, Codex CLI, Claude Code), installed by npm into
.test-cache/agents once per cache. SmolLM2 is served with at most its trained 8192 tokens, smaller
than the prompts Copilot and Claude Code send by default, so what these tests can show differs
per agent: Copilot refuses by itself once it has read the budget launch gave it (proof that it took
our provider), the others get real answers or our errors from the daemon.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prefetch import agent_bin
from daemon_util import cli, cli_env, free_port, register_model, stop_quietly, wait_published, start_serve
from localserve.commands.launch import AgentOverriddenError, refuse_overrides, run_agent, run_files
from localserve.desktop.agents import (AGENTS, CLAUDE_PROVIDER_SWITCHES, CODEX_TOKEN_VAR, Target,
                                       claude_managed_overrides, context_warning)

TARGET = Target("http://127.0.0.1:5555", "tok", "smollm2-135m:Q4_1", 8192)


def test_claude_gets_every_tier_and_our_token() -> None:
    env = AGENTS["claude"].environment(TARGET)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5555"
    assert env["ANTHROPIC_AUTH_TOKEN"] == "tok" and env["ANTHROPIC_API_KEY"] == ""
    for tier in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[tier] == "smollm2-135m:Q4_1"
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "8192"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert all(env[switch] == "" for switch in CLAUDE_PROVIDER_SWITCHES)  # no Bedrock, Vertex, ... from a file
    assert AGENTS["claude"].arguments(TARGET)[0] == "--settings"  # its file: the next test


def test_claude_gets_the_same_in_its_command_line_settings_layer_by_a_private_file() -> None:
    """`--settings` outranks the user's settings files; the token rides in a 0600 file, not argv."""
    agent = AGENTS["claude"]
    with run_files(agent, TARGET) as target:
        path = target.path("settings.json")
        assert stat.S_IMODE(os.stat(target.workdir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert json.loads(Path(path).read_text()) == {"env": agent.environment(TARGET)}
        assert json.loads(Path(path).read_text())["env"]["ANTHROPIC_AUTH_TOKEN"] == "tok"
        command = agent.command("/bin/claude", target, ["-p", "hi"])
        assert command == ["/bin/claude", "--settings", path, "-p", "hi"]
        assert not any("tok" in arg for arg in command)
    assert not os.path.exists(target.workdir)
    with run_files(AGENTS["codex"], TARGET) as same:
        assert same is TARGET  # nothing to write


def test_managed_claude_settings_that_route_requests_are_refused(tmp_path: Path) -> None:
    """Managed settings are the one layer above `--settings`: launch names what would win and stops."""
    assert claude_managed_overrides(tmp_path) == []  # nothing there
    (tmp_path / "managed-settings.json").write_text('{"env": {"DISABLE_TELEMETRY": "1"}, "apiKeyHelper": "x"}')
    assert claude_managed_overrides(tmp_path) == []  # tuning, and a helper our token outranks
    drop_in = tmp_path / "managed-settings.d"
    drop_in.mkdir()
    gateway = {"env": {"ANTHROPIC_BASE_URL": "https://gw", "CLAUDE_CODE_USE_VERTEX": "1"}}
    (drop_in / "10-gateway.json").write_text(json.dumps(gateway))
    (drop_in / ".hidden.json").write_text('{"env": {"ANTHROPIC_AUTH_TOKEN": "x"}}')  # Claude Code skips dotfiles
    (drop_in / "bad.json").write_text("{not json")
    assert claude_managed_overrides(tmp_path) == [f"{drop_in / '10-gateway.json'}: env.ANTHROPIC_BASE_URL",
                                                   f"{drop_in / '10-gateway.json'}: env.CLAUDE_CODE_USE_VERTEX"]
    found = claude_managed_overrides(tmp_path)
    agent = AGENTS["claude"]
    with pytest.raises(AgentOverriddenError, match="managed settings .* outrank .*env.ANTHROPIC_BASE_URL"):
        refuse_overrides(dataclasses.replace(agent, overrides=lambda: found))
    refuse_overrides(AGENTS["codex"])  # nothing of Codex's outranks its -c overrides


def test_codex_gets_a_responses_provider_by_overrides() -> None:
    agent = AGENTS["codex"]
    args = agent.arguments(TARGET)
    assert args[::2] == ["-c"] * (len(args) // 2)
    overrides = dict(value.split("=", 1) for value in args[1::2])
    assert overrides["model_provider"] == '"localserve"'
    assert overrides["model"] == '"smollm2-135m:Q4_1"'
    assert overrides["model_context_window"] == "8192"
    assert overrides["model_providers.localserve.base_url"] == '"http://127.0.0.1:5555/v1"'
    assert overrides["model_providers.localserve.wire_api"] == '"responses"'
    assert overrides["model_providers.localserve.env_key"] == f'"{CODEX_TOKEN_VAR}"'
    assert agent.environment(TARGET) == {CODEX_TOKEN_VAR: "tok"}
    # The user's own arguments come after ours, so theirs win where Codex lets a later -c win.
    assert agent.command("/bin/codex", TARGET, ["exec", "hi"])[-2:] == ["exec", "hi"]


def test_copilot_gets_a_provider_and_a_budget_inside_the_context() -> None:
    env = AGENTS["copilot"].environment(TARGET)
    assert env["COPILOT_PROVIDER_BASE_URL"] == "http://127.0.0.1:5555/v1"
    assert env["COPILOT_PROVIDER_TYPE"] == "openai" and env["COPILOT_PROVIDER_WIRE_API"] == "completions"
    assert env["COPILOT_MODEL"] == "smollm2-135m:Q4_1" and env["COPILOT_PROVIDER_API_KEY"] == "tok"
    budget = int(env["COPILOT_PROVIDER_MAX_PROMPT_TOKENS"]) + int(env["COPILOT_PROVIDER_MAX_OUTPUT_TOKENS"])
    assert budget <= 8192
    # The user's own provider variables would win over ours (a bearer token over the key, a wire
    # model over the model, extra headers): none is passed on.
    inherited = {"PATH": "/bin", "COPILOT_PROVIDER_BEARER_TOKEN": "theirs", "COPILOT_PROVIDER_WIRE_MODEL": "gpt-5",
                 "COPILOT_PROVIDER_API_KEY_COMMAND": "pass show x", "COPILOT_PROVIDER_HEADERS": "X-Tenant: 1"}
    assert AGENTS["copilot"].environ(TARGET, inherited) == {"PATH": "/bin", **env}


def test_context_warning_only_when_the_agent_prompt_does_not_fit() -> None:
    copilot = AGENTS["copilot"]
    assert "12275 tokens" in (context_warning(copilot, TARGET) or "")
    roomy = Target(TARGET.base_url, TARGET.token, TARGET.model, 32768)
    assert context_warning(copilot, roomy) is None


def test_arguments_after_the_double_dash_are_only_for_launch(tmp_path: Path) -> None:
    env = cli_env(tmp_path, free_port())
    result = cli(env, "hw", "--", "x")
    assert result.returncode == 2 and "takes no arguments after `--`" in result.stderr


def test_a_missing_agent_says_how_to_install_it(tmp_path: Path) -> None:
    env = cli_env(tmp_path, free_port(), PATH=str(Path(sys.executable).parent), HOME=str(tmp_path))
    result = cli(env, "launch", "claude", "--", "-p", "hi")
    assert result.returncode == 1
    assert "Claude Code is not installed" in result.stderr
    assert "npm install -g @anthropic-ai/claude-code" in result.stderr
    assert "Traceback" not in result.stderr


# --- the real agents ---------------------------------------------------------------------------


def installed_agent(name: str) -> Path:
    """The agent's executable from .test-cache/agents, installed there by npm on first use."""
    if shutil.which("npm") is None:
        pytest.skip("needs npm (apt-get install npm)")
    executable = agent_bin(name) / AGENTS[name].executable
    assert executable.exists()
    return executable


API_KEY = "ls-key-8c1e5f0a-never-in-argv"


def serve_for_agents(tmp_path: Path, smollm2_gguf: Path, context: int):
    """A daemon serving SmolLM2 with `context` tokens, and the env `launch` runs in: the agents' own
    state under a fresh HOME, the agents first on PATH. The daemon has an api_key, so an agent that
    reaches it with any other token is refused."""
    # Codex names no output limit and samples at temperature 1: SmolLM2 sometimes rambles on (a CI
    # run saw 2,700 tokens, 156 s here against 47 s), so the daemon caps an answer that names none.
    env = cli_env(tmp_path / "home", free_port(), LOCALSERVE_CONTEXT_LENGTH=str(context),
                  LOCALSERVE_DEFAULT_MAX_TOKENS="256", LOCALSERVE_API_KEY=API_KEY, HOME=str(tmp_path))
    register_model(env, smollm2_gguf)
    proc = start_serve(env)
    try:
        wait_published(tmp_path / "home", proc)
        yield env
    finally:
        stop_quietly(env, proc)


@pytest.fixture
def daemon(tmp_path: Path, smollm2_gguf: Path):
    """SmolLM2 with its full trained context (8192)."""
    yield from serve_for_agents(tmp_path, smollm2_gguf, 8192)


@pytest.fixture
def tight_daemon(tmp_path: Path, smollm2_gguf: Path):
    """SmolLM2 with 4096 tokens: Codex's and Claude Code's whole default prompts, even with their
    tools listed compactly for a template without tools (Codex's about 5,000 tokens), do not fit, so
    each agent shows our context error."""
    yield from serve_for_agents(tmp_path, smollm2_gguf, 4096)


def launch(env: dict[str, str], agent: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    bin_dir = installed_agent(agent).parent
    run_env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "localserve", "launch", agent, "smollm2-135m", "--", *args],
                          env=run_env, cwd=env["HOME"], capture_output=True, text=True, timeout=timeout)


class Capture(http.server.ThreadingHTTPServer):
    """Somewhere else an agent could be sent (a company gateway): records each request, answers 401."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        capture = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                capture.seen.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                     "model": json.loads(body or b"{}").get("model")})
                answer = b'{"error": {"type": "authentication_error", "message": "captured"}}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_HEAD = do_POST

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def capture():
    server = Capture()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class ArgvWatch(threading.Thread):
    """Every process's command line, read from /proc while an agent runs: the key must be in none."""

    def __init__(self, secret: str, marker: bytes) -> None:
        super().__init__(daemon=True)
        self.secret, self.marker = secret.encode(), marker
        self.leaked: list[bytes] = []
        self.agent_seen = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            for entry in Path("/proc").iterdir():
                try:
                    argv = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
                except OSError:
                    continue
                self.agent_seen |= self.marker in argv
                if self.secret in argv:
                    self.leaked.append(argv)

    def __enter__(self) -> "ArgvWatch":
        if not Path("/proc/self/cmdline").exists():
            pytest.skip("reads command lines from /proc")
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()


def test_copilot_takes_our_provider_and_budget(daemon: dict[str, str]) -> None:
    result = launch(daemon, "copilot", "-p", "Say hello", "--allow-all-tools", "--no-custom-instructions")
    # Our warning first, then Copilot's own refusal, which it can only give from the prompt budget
    # launch set: without COPILOT_PROVIDER_BASE_URL it would ask for a GitHub login instead.
    assert "Copilot CLI sends about" in result.stderr
    assert "exceed the model's usable context budget" in result.stdout + result.stderr
    assert "log in" not in (result.stdout + result.stderr).lower()


def test_claude_code_shows_our_error_when_its_prompt_does_not_fit(tight_daemon: dict[str, str]) -> None:
    result = launch(tight_daemon, "claude", "-p", "Say hello")
    assert "Claude Code sends about" in result.stderr  # launch's warning, before the agent starts
    assert "this model's context is 4096 tokens" in result.stdout + result.stderr  # our 400, shown by Claude Code


def test_claude_code_comes_to_us_past_the_users_own_gateway_settings(tight_daemon: dict[str, str],
                                                                    capture: Capture) -> None:
    """Issue 49 #6: a user's ~/.claude/settings.json names a gateway (its URL, its token, Bedrock).
    Its `env` beat launch's environment before; the command-line settings layer beats it. The
    daemon has an api_key: only our token gets its 400, any other would be a 401."""
    settings = Path(tight_daemon["HOME"]) / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"env": {"ANTHROPIC_BASE_URL": capture.url, "ANTHROPIC_AUTH_TOKEN": "gateway-token",
                                            "ANTHROPIC_API_KEY": "sk-ant-theirs", "CLAUDE_CODE_USE_BEDROCK": "1"},
                                    "apiKeyHelper": "echo helper-key"}))
    with ArgvWatch(API_KEY, b"--settings") as watch:
        result = launch(tight_daemon, "claude", "-p", "Say hello")
    assert "this model's context is 4096 tokens" in result.stdout + result.stderr, result.stdout + result.stderr
    assert capture.seen == []
    assert watch.agent_seen and watch.leaked == []
    log = (Path(tight_daemon["LOCALSERVE_HOME"]) / "logs" / "localserve.log").read_text()
    assert '"POST /v1/messages?beta=true HTTP/1.1" 400' in log and '" 401 ' not in log
    assert json.loads(settings.read_text())["env"]["ANTHROPIC_BASE_URL"] == capture.url  # theirs, untouched
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("localserve-claude-*"))  # ours, gone


# Codex's default tools and instructions are 9127 tokens (0.171.0); without its sub-agent, goal and
# image tools and web search they are about 5,500, which SmolLM2's 8192 holds.
CODEX_SMALL = ["--disable", "multi_agent", "--disable", "goals", "--disable", "image_generation",
               "--disable", "view_image", "-c", "web_search=disabled"]


@pytest.mark.timeout(900)  # a 5,500-token prefill on a busy 2-core machine
def test_codex_answers_from_the_local_model_over_the_responses_api(daemon: dict[str, str]) -> None:
    result = launch(daemon, "codex", "exec", "--skip-git-repo-check", *CODEX_SMALL, "Say hello", timeout=800)
    out = result.stdout + result.stderr
    # Codex shows the model's answer after a line "codex". Where SmolLM2 rambles past the daemon's
    # default_max_tokens, our answer is `incomplete` with reason max_output_tokens, as OpenAI's would
    # be, and Codex exits 1 after showing it. Either way the answer came from the local model over
    # the Responses API.
    answer = out.split("\ncodex\n", 1)[1] if "\ncodex\n" in out else ""
    assert answer.strip(), out
    assert result.returncode == 0 or "Incomplete response returned, reason: max_output_tokens" in out, out
    assert "tokens used" in out
    log = (Path(daemon["LOCALSERVE_HOME"]) / "logs" / "localserve.log").read_text()
    assert '"POST /v1/responses HTTP/1.1" 200' in log


def test_codex_reads_our_context_error_as_its_own(tight_daemon: dict[str, str]) -> None:
    result = launch(tight_daemon, "codex", "exec", "--skip-git-repo-check", "Say hello")
    assert "Codex CLI sends about" in result.stderr
    # Our 400's code (context_length_exceeded) is the one Codex knows: it says so in its own words.
    assert "ran out of room in the model's context window" in result.stdout + result.stderr


def test_codex_comes_to_us_past_a_config_toml_naming_another_provider(tight_daemon: dict[str, str],
                                                                      capture: Capture) -> None:
    """Codex's `-c` overrides outrank the user's config.toml (its own provider and model)."""
    config = Path(tight_daemon["HOME"]) / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'model_provider = "corp"\nmodel = "corp-model"\n\n[model_providers.corp]\nname = "corp"\n'
                      f'base_url = "{capture.url}/v1"\nwire_api = "responses"\n')
    with ArgvWatch(API_KEY, b"codex") as watch:
        result = launch(tight_daemon, "codex", "exec", "--skip-git-repo-check", "Say hello")
    assert "ran out of room in the model's context window" in result.stdout + result.stderr
    assert capture.seen == [] and watch.agent_seen and watch.leaked == []


def test_copilot_ignores_the_users_own_provider_variables(capture: Capture, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A bearer token, a wire model and headers of the user's, inherited, would win over ours. The
    "daemon" here is the capture server, so Copilot's requests can be read whole."""
    executable = str(installed_agent("copilot"))
    target = Target(capture.url, "our-token", "our-model", 131072)  # roomy: Copilot sends at once
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COPILOT_PROVIDER_BEARER_TOKEN", "their-token")
    monkeypatch.setenv("COPILOT_PROVIDER_WIRE_MODEL", "their-model")
    monkeypatch.setenv("COPILOT_PROVIDER_HEADERS", "X-Tenant: theirs")
    run_agent(AGENTS["copilot"], executable, target,
              ["-p", "Say hello", "--allow-all-tools", "--no-custom-instructions"])
    assert capture.seen, "Copilot sent nothing"
    for request in capture.seen:
        assert request["headers"].get("authorization") == "Bearer our-token" and request["model"] == "our-model"
        assert "x-tenant" not in request["headers"]
