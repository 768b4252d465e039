"""Draft selection and residency: `predictor show`. Collecting traces, training the predictor
from them, the simulator and its device profiles are the lab's (`traces collect`, `predictor
train`, `simulate`, `sim calibrate`: memspec_lab.cli), listed here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memspec.cli import lab


def cmd_predictor_show(args: argparse.Namespace) -> int:
    from memspec.predictor.model import load_predictor

    pred = load_predictor(Path(args.path))
    print(json.dumps(pred.describe(), indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    lab.add(sub, "traces")

    p = sub.add_parser("predictor", help="the acceptance predictor: train from traces, show")
    psub = p.add_subparsers(dest="action", required=True)
    lab.add(psub, "predictor", "train")
    s = psub.add_parser("show", help="describe an artifact")
    s.add_argument("path")
    s.set_defaults(func=cmd_predictor_show)

    lab.add(sub, "simulate")
    lab.add(sub, "sim")
