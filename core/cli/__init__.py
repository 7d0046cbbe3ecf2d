"""The ``layerwise`` command: one module per subcommand, each a thin layer over a verb.

Owns argument parsing and printing only; every decision is made by the modules it calls.
May import anything in layerwise; nothing imports it (but ``__main__``).
"""

from layerwise.cli.app import build_parser, console, main

__all__ = ["build_parser", "console", "main"]
