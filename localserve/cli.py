"""Terminal entry point: parses flags, loads settings once, dispatches to `commands/`.

Each module in `commands/` owns its subcommands: `register(subparsers, common)` adds parsers whose
`func(args, settings) -> int` runs the command. Errors from our tree print as one line, never a
traceback; Ctrl-C exits 130 quietly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

from . import __version__
from .config.settings import load_settings
from .errors import LocalserveError

# Modules under localserve/commands/, each registering its own subcommands.
COMMAND_MODULES = ("models", "hw", "settings", "daemon", "desktop", "setup", "service", "convert", "upstream", "batch", "launch")

# Flags shared by every subcommand; each maps 1:1 to a Settings field.
SETTING_FLAGS = {
    "--home": ("home", "model cache and state directory (LOCALSERVE_HOME)"),
    "--host": ("host", "daemon address (LOCALSERVE_HOST)"),
    "--port": ("port", "daemon port (LOCALSERVE_PORT)"),
    "--catalog": ("catalog", "extra catalog JSON file (LOCALSERVE_CATALOG)"),
    "--backend": ("backend", "auto, llamacpp or onnx (LOCALSERVE_BACKEND)"),
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    for flag, (dest, help_text) in SETTING_FLAGS.items():
        common.add_argument(flag, dest=f"setting_{dest}", default=argparse.SUPPRESS, help=help_text)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")

    parser = argparse.ArgumentParser(prog="localserve", description="Run LLMs locally.", parents=[common])
    parser.add_argument("--version", action="version", version=f"localserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(subparsers, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the program a command runs (`launch claude -- -p
    # hi`), split off here: argparse's REMAINDER keeps or drops a `--` depending on what precedes it.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if passthrough and not hasattr(args, "passthrough"):
        parser.error(f"`{args.command or 'localserve'}` takes no arguments after `--`")
    if hasattr(args, "passthrough"):
        args.passthrough = passthrough
    flags = {key[len("setting_"):]: value for key, value in vars(args).items() if key.startswith("setting_")}
    if not getattr(args, "func", None):
        # Bare `localserve` (a desktop launcher, a first try): where the dashboard is; the commands
        # stay one `--help` away.
        from .commands.desktop import dashboard_hint

        try:
            print(dashboard_hint(load_settings(flags)))
            return 0
        except LocalserveError:
            parser.print_help()  # a broken config: the help is still useful
            return 2
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = load_settings(flags)
        return int(args.func(args, settings) or 0)
    except LocalserveError as e:
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\nInterrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `localserve hw --json | head` closed our stdout: not an error of ours. Point stdout at
        # devnull so the interpreter's final flush does not raise a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
