from pathlib import Path

import pytest

from localserve.config.settings import DEFAULT_PORT, describe, load_settings
from localserve.errors import ConfigError


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('port = 9000\nhost = "127.0.0.2"\nkeep-alive = 60\n')
    env = {"LOCALSERVE_PORT": "9100", "LOCALSERVE_HOME": str(tmp_path / "home")}

    s = load_settings({"port": "9200"}, environ=env, config_path=cfg)

    assert s.port == 9200 and s.sources["port"] == "flag --port"
    assert s.host == "127.0.0.2" and s.sources["host"].startswith("config file")
    assert s.keep_alive == 60.0
    assert s.home == tmp_path / "home" and s.sources["home"] == "env LOCALSERVE_HOME"
    assert s.queue_size == 64 and s.sources["queue_size"] == "default"


def test_defaults_without_any_source(tmp_path: Path) -> None:
    s = load_settings(environ={}, config_path=tmp_path / "missing.toml")
    assert s.port == DEFAULT_PORT and s.host == "127.0.0.1"
    assert s.port not in (11434, 1234, 8080)


def test_api_key_is_masked_in_description(tmp_path: Path) -> None:
    s = load_settings(environ={"LOCALSERVE_API_KEY": "secret"}, config_path=tmp_path / "none.toml")
    rows = {name: (value, source) for name, value, source in describe(s)}
    assert rows["api_key"] == ("****", "env LOCALSERVE_API_KEY")


@pytest.mark.parametrize(
    "content, message",
    [("port = [", "not valid TOML"), ("colour = 1", "unknown setting"), ('port = "many"', "not a valid int")],
)
def test_bad_config_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_settings(environ={}, config_path=cfg)


def test_negative_and_malformed_env_values_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must not be negative"):
        load_settings(environ={"LOCALSERVE_QUEUE_SIZE": "-1"}, config_path=tmp_path / "x.toml")
    with pytest.raises(ConfigError, match="not a valid float"):
        load_settings(environ={"LOCALSERVE_KEEP_ALIVE": "soon"}, config_path=tmp_path / "x.toml")


def test_cors_origins_from_env_list(tmp_path: Path) -> None:
    s = load_settings(environ={"LOCALSERVE_CORS_ORIGINS": "http://a.localhost, app://x"}, config_path=tmp_path / "x")
    assert s.cors_origins == ("http://a.localhost", "app://x")
