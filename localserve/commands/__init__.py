"""CLI subcommands, one module per family; see cli.py for the registration contract."""
