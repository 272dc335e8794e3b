"""`localserve upstream add|list|rm` edit the user's config.toml: other settings and comments kept,
keys masked when listed, the file private once it holds a key, a bad URL refused with the file
untouched; `list` and `config` show remote models and upstreams without the key."""

from __future__ import annotations

import stat
from pathlib import Path

from daemon_util import cli, cli_env, free_port


def test_upstream_commands_edit_config_safely(tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text("# mine\nkeep_alive = 42.0  # a comment\n")
    config.chmod(0o644)
    env = cli_env(tmp_path, free_port(), LOCALSERVE_CONFIG=str(config))
    r = cli(env, "upstream", "add", "gpu", "http://127.0.0.1:9/v1", "--api-key", "sk-secret-123",
            "--model", "Org/Big=big", "--max-concurrency", "2")
    assert r.returncode == 0, r.stderr
    r = cli(env, "upstream", "add", "ray", "https://ray.example:8000/v1/", "--api-key-env", "RAY_KEY")
    assert r.returncode == 0, r.stderr
    text = config.read_text()
    assert text.startswith("# mine\nkeep_alive = 42.0  # a comment\n") and text.count("[[upstreams]]") == 2
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    bad = cli(env, "upstream", "add", "evil", "file:///etc/passwd")
    assert bad.returncode != 0 and "http" in bad.stderr and config.read_text() == text
    for args in (("upstream", "list"), ("config",), ("list", "--json")):
        out = cli(env, *args)
        assert out.returncode == 0 and "sk-secret-123" not in out.stdout + out.stderr, args
    assert "big" in cli(env, "list").stdout and "remote (gpu)" in cli(env, "list").stdout
    assert cli(env, "upstream", "rm", "gpu").returncode == 0
    text = config.read_text()
    assert "gpu" not in text and "sk-secret-123" not in text and 'url = "https://ray.example:8000/v1"' in text
    assert "keep_alive = 42.0" in text and cli(env, "upstream", "rm", "gpu").returncode != 0
