"""`memspec rpc-worker`: serve this device's compute to a daemon whose target is split over
devices (ggml RPC)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memspec.rpc.endpoints import DEFAULT_PORT


def cmd_rpc_worker(args: argparse.Namespace) -> int:
    from memspec.rpc.worker import serve_worker

    print(f"memspec rpc-worker: serving on {args.host}:{args.port}", file=sys.stderr, flush=True)
    serve_worker(args.host, args.port, args.threads, args.cache, args.allow_remote)
    return 0


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi] (a usage error, not a traceback, otherwise)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}: {text[:40]!r}")
        return v

    parse.__name__ = "int"
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rpc-worker",
        help="serve this device's compute to a daemon over ggml RPC (no authentication: "
        "loopback unless --allow-remote)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=_int_in(1, 65535),
        default=DEFAULT_PORT,
        help=f"port (default {DEFAULT_PORT})",
    )
    p.add_argument("--threads", type=_int_in(1, 1024), help="CPU threads (default: all cores)")
    p.add_argument("--cache", type=Path, help="keep received tensors here (faster reloads)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="bind an address other than loopback: anyone who reaches it can use this device",
    )
    p.set_defaults(func=cmd_rpc_worker)
