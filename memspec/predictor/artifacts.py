"""Which predictor artifact a target gets.

A predictor is learnt on one target's traces (its draft ids and how often each is accepted).
The daemon therefore looks for one trained on its own target first:

1. `settings.predictor`, when set;
2. `<data>/predictors/<target slug>.json`, what `memspec predictor train` writes by default
   from the user's own traces;
3. `predictors/<target slug>.json` in the checkout, one shipped for a testbed target;
4. `predictors/smollm2-mtbench.json`, the testbed's: its lookup and datastore keys carry over
   to any target, and keys it lacks start from per-kind priors.
"""

from __future__ import annotations

from pathlib import Path

from memspec.drafts.family import slug
from memspec.paths import DEFAULT_PREDICTOR, data_dir

SHIPPED_DIR = DEFAULT_PREDICTOR.parent


def trained_path(target: Path) -> Path:
    """Where `memspec predictor train` puts a predictor for `target` by default."""
    return data_dir() / "predictors" / f"{slug(target)}.json"


def predictor_path(target: Path, configured: Path | None = None) -> Path:
    """The artifact the daemon loads for `target` (the order is the module's docstring)."""
    if configured is not None:
        return configured
    for candidate in (trained_path(target), SHIPPED_DIR / f"{slug(target)}.json"):
        if candidate.is_file():
            return candidate
    return DEFAULT_PREDICTOR
