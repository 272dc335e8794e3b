"""`localserve config`: the effective settings and where each value came from."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..config.settings import Settings, config_file_path, describe


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("config", parents=[common], help="show effective settings and their sources")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_config)


def run_config(args: argparse.Namespace, settings: Settings) -> int:
    rows = describe(settings)
    if args.json:
        print(json.dumps({name: {"value": value, "source": source} for name, value, source in rows}, indent=2))
        return 0
    table = Table(title=f"localserve settings (config file: {config_file_path()})")
    for column in ("setting", "value", "source"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0
