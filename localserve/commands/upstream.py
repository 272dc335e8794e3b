"""`localserve upstream add|list|rm`: the [[upstreams]] tables of the user's config.toml.

The file is edited as text so the user's other settings and comments stay as they were: every
[[upstreams]] block is dropped and the new list appended at the end (upstreams are the only
tables; top-level settings come before any table). The result is parsed by load_settings before
it replaces the file, atomically (temporary file + rename, the old file's permissions, 0600 for a
new one since it may hold a key).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

from ..config.settings import Settings, config_file_path, load_settings
from ..errors import ConfigError
from ..config.upstreams import DEFAULT_MAX_CONCURRENCY, UpstreamConfig, parse_upstream

_HEADER = re.compile(r"^\s*\[")
_UPSTREAM_HEADER = re.compile(r"^\s*\[\[\s*upstreams\s*\]\]\s*(#.*)?$")


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("upstream", parents=[common], help="remote OpenAI-compatible engines (vLLM, Ray Serve, ...)")
    sub = p.add_subparsers(dest="upstream_command", metavar="ACTION", required=True)
    add = sub.add_parser("add", parents=[common], help="add or replace an upstream in config.toml")
    add.add_argument("name")
    add.add_argument("url", help="its OpenAI base URL, e.g. http://gpu-box:8000/v1")
    add.add_argument("--api-key-env", help="environment variable holding its API key (preferred)")
    add.add_argument("--api-key", help="its API key, written into config.toml (made private)")
    add.add_argument("--model", action="append", dest="models", metavar="REMOTE[=ALIAS]",
                     help="expose only these models (repeatable); default: all it lists")
    add.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY)
    add.add_argument("--priority-field", help="forward the lane's rank in this field (vLLM: priority)")
    add.set_defaults(func=run_add)
    ls = sub.add_parser("list", parents=[common], help="configured upstreams (keys masked)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_list)
    rm = sub.add_parser("rm", parents=[common], help="remove an upstream from config.toml")
    rm.add_argument("name")
    rm.set_defaults(func=run_rm)


def run_add(args: argparse.Namespace, settings: Settings) -> int:
    table = {"name": args.name, "url": args.url, "models": args.models or ["*"],
             "max_concurrency": args.max_concurrency}
    for key in ("api_key", "api_key_env", "priority_field"):
        if getattr(args, key):
            table[key] = getattr(args, key)
    new = parse_upstream(table, 0)
    kept = [u for u in _file_upstreams() if u.name != new.name]
    write_upstreams([*kept, new])
    print(f"Upstream {new.name} -> {new.url} saved; restart the daemon (localserve stop) to use it.")
    return 0


def run_rm(args: argparse.Namespace, settings: Settings) -> int:
    current = _file_upstreams()
    if not any(u.name == args.name for u in current):
        raise ConfigError(f"no upstream named {args.name!r} in {config_file_path().name}")
    write_upstreams([u for u in current if u.name != args.name])
    print(f"Upstream {args.name} removed.")
    return 0


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    if args.json:
        print(json.dumps([{**u.to_table(), "api_key": "****" if u.api_key else None} for u in settings.upstreams],
                         indent=2))
    elif not settings.upstreams:
        print("No upstreams configured. Add one: localserve upstream add NAME URL")
    for u in [] if args.json else settings.upstreams:
        print(u.shown())
    return 0


def _file_upstreams() -> list[UpstreamConfig]:
    """The upstreams of the config file itself (not the environment's), keys as written there."""
    path = config_file_path()
    return list(load_settings(environ={}, config_path=path).upstreams) if path.is_file() else []


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def without_upstream_blocks(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if _UPSTREAM_HEADER.match(line):
            skipping = True
        elif _HEADER.match(line):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out).rstrip() + "\n" if any(s.strip() for s in out) else ""


def write_upstreams(upstreams: list[UpstreamConfig], path: Path | None = None) -> None:
    path = path or config_file_path()
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    text = without_upstream_blocks(old)
    for u in upstreams:
        text += "\n[[upstreams]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in u.to_table().items())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        mode = (path.stat().st_mode & 0o777) if path.is_file() else 0o600
        if any(u.api_key and not u.api_key_env for u in upstreams):
            mode &= 0o600  # a key written into the file: readable by its owner only
        os.chmod(tmp, mode)
        load_settings(environ={}, config_path=Path(tmp))  # refuse to write a file we cannot read back
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
