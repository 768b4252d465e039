"""Where models, data and caches live: the loaded settings' data_dir (`use_data_dir`), else
$MEMSPEC_DATA_DIR, else ./data beside the checkout."""

from __future__ import annotations

from pathlib import Path

from memspec.config import env_data_dir

# The acceptance predictor shipped in the checkout (settings.predictor overrides it).
DEFAULT_PREDICTOR = Path(__file__).resolve().parent.parent / "predictors" / "smollm2-mtbench.json"


_chosen: Path | None = None  # the loaded settings' data_dir (use_data_dir)


def use_data_dir(path: Path | None) -> None:
    """The data dir the loaded settings name (settings.data_dir, from a flag, the env or the
    TOML file): whoever loads settings for the process passes it here. None: the environment's
    or the default."""
    global _chosen
    _chosen = Path(path) if path is not None else None


def data_dir() -> Path:
    return _chosen or env_data_dir() or Path(__file__).resolve().parent.parent / "data"


def models_dir() -> Path:
    return data_dir() / "models"


def store_dir() -> Path:
    """memspec's own model store, in Ollama's layout (memspec.ollama_store): pulled and
    created models."""
    return models_dir() / "store"


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
