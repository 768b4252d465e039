"""`memspec serve`: the daemon."""

from __future__ import annotations

import argparse
import sys

from memspec.cli.flags import SERVE_SETTINGS, add_settings_flags, model_flags, settings_overrides


def cmd_serve(args: argparse.Namespace) -> int:
    from memspec.server.serve import serve

    try:
        return serve(args.config, **settings_overrides(args))
    except OSError as e:
        print(f"memspec: error: {e}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the daemon: OpenAI-compatible API, admin API, metrics")
    model_flags(p)
    add_settings_flags(p, SERVE_SETTINGS)
    p.set_defaults(func=cmd_serve)
