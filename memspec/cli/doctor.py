"""`memspec doctor`: which kernels run, and how setup proved the build runs every model kind."""

from __future__ import annotations

import argparse
import json


def cmd_doctor(args: argparse.Namespace) -> int:
    from memspec.doctor import kernel_report, render

    report = kernel_report()
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="the llama.cpp build: CPU kernels, flags, setup's probe")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_doctor)
