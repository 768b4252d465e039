"""Where models, data and caches live: $MEMSPEC_DATA_DIR, default ./data beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

# The acceptance predictor shipped in the checkout (settings.predictor overrides it).
DEFAULT_PREDICTOR = Path(__file__).resolve().parent.parent / "predictors" / "smollm2-mtbench.json"


def data_dir() -> Path:
    env = os.environ.get("MEMSPEC_DATA_DIR")
    base = Path(env) if env else Path(__file__).resolve().parent.parent / "data"
    return base


def models_dir() -> Path:
    return data_dir() / "models"


def cache_dir() -> Path:
    return data_dir() / "cache"


def mtbench_path() -> Path:
    return data_dir() / "mt_bench" / "question.jsonl"


def humaneval_path() -> Path:
    return data_dir() / "human_eval" / "HumanEval.jsonl.gz"


def resolve_model_path(name: str) -> Path:
    """A model named in settings: a path as given, or a plain file name in the models dir."""
    p = Path(name)
    if p.is_absolute() or p.parent != Path("."):
        return p
    return models_dir() / name
