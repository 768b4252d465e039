"""The `memspec` command: main.py builds the parser; each other module is a command group."""

from memspec.cli.main import main

__all__ = ["main"]
