"""`memspec-ctl`: client.py talks to the daemon, render.py formats, main.py is the command line."""

from memspec.ctl.main import main

__all__ = ["main"]
