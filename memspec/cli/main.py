"""`memspec`: serve, generate, build drafts, calibrate, benchmark."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from memspec.cli import create, doctor, drafts, generate, lab, pull, rpc, scheduling, serve
from memspec.config import settings_error
from memspec.errors import MemSpecError
from memspec.memory.huge_pages import reexec_with_huge_pages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memspec", description=__doc__, epilog=lab.EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    # the order of `--help` (the lab's commands, cli/lab.py, among them)
    for group in (drafts, pull, create, generate, serve, rpc):
        group.register(sub)
    lab.add(sub, "bench")
    for group in (scheduling, doctor):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own command line: malloc on huge pages first
        reexec_with_huge_pages()
        argv = sys.argv[1:]
    words = lab.command_of(argv)
    parser = build_parser() if words is None else lab.lab_parser(words)
    if parser is None:  # a lab command without the lab: said on stderr
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MemSpecError as e:
        print(f"memspec: error: {e.message}", file=sys.stderr)
        return 2
    except ValidationError as e:  # MEMSPEC_BUDGET=<400 digits>: one line, not pydantic's page
        print(f"memspec: error: {settings_error(e)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"memspec: error: {e}", file=sys.stderr)
        return 2
