"""`memspec`: serve, generate, build drafts, calibrate, benchmark."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from memspec.cli import bench, doctor, drafts, generate, pull, rpc, scheduling, serve
from memspec.config import settings_error
from memspec.errors import MemSpecError
from memspec.memory.huge_pages import reexec_with_huge_pages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # the order of `--help`
    for group in (drafts, pull, generate, serve, rpc, bench, scheduling, doctor):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own command line: malloc on huge pages first
        reexec_with_huge_pages()
    args = build_parser().parse_args(argv)
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
