"""What a runtime has learnt about its target, kept across restarts.

A restarted daemon, or the next `memspec generate`, starts where the last one stopped instead
of from the per-kind priors: the acceptance counts per draft (and per draft and prompt class)
of the decision rule and of each named policy's rule, the predictor's online weights, and
which drafts were resident (the preload of a default pool starts with them). Costs need no
entry here: calibration is cached per model files (memspec.engine.calibration).

One JSON file per target, `<state_dir>/learned/<target slug>.json`, written atomically (a
temporary file, then os.replace) when a runtime closes and at most once a minute while it
serves. It is only advice: one that is unreadable, of another format or of another file with
the target's name is ignored with a log line, and entries for drafts no longer in the pool
are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from memspec.predictor.model import AcceptancePredictor

if TYPE_CHECKING:
    from memspec.engine.costs import AcceptanceEstimator
    from memspec.scheduler.rounds import Scheduler
    from memspec.scheduler.working_set import WorkingSet


class Learner(Protocol):
    """What is learnt and where it lives: the pool, the acceptance estimates, the scheduler's
    rules and predictor, the working set. Read when saving and restoring, not when a Memory is
    made: a runtime (memspec.runtime.Runtime is one) has its scheduler only once it has started."""

    estimator: AcceptanceEstimator
    scheduler: Scheduler
    working_set: WorkingSet | None

    @property
    def manifests(self) -> Mapping[str, object]: ...  # the pool, by draft id, in pool order

    def new_estimator(self) -> AcceptanceEstimator: ...


log = logging.getLogger("memspec.learned")

FORMAT, VERSION = "memspec-learned", 1
SAVE_EVERY_S = 60.0


def learned_path(state_dir: Path, target: Path) -> Path:
    from memspec.drafts.family import slug

    return state_dir / "learned" / f"{slug(target)}.json"


def _target_id(target: Path) -> dict[str, Any]:
    return {"file": target.name, "bytes": target.stat().st_size}


def snapshot(rt: Learner, target: Path) -> dict[str, Any]:
    """What `rt` has learnt, as the file holds it."""
    sched = rt.scheduler
    resident = rt.working_set.resident_ids() if rt.working_set else set()
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": _target_id(target),
        "estimator": rt.estimator.counts(),
        "rule_estimators": {n: e.counts() for n, e in sched.rule_estimators.items()},
        "predictor": sched.predictor.to_dict(),
        # In pool order (a set has none): the preload takes them first, in this order.
        "resident": [i for i in rt.manifests if rt.working_set and i in resident],
    }


def save(rt: Learner, target: Path, path: Path) -> None:
    """Write atomically; a failure is logged, never raised (it is only advice)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(snapshot(rt, target)) + "\n")
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        log.warning("could not save what was learnt to %s: %s", path, e)


def read(path: Path, target: Path) -> dict[str, Any] | None:
    """The saved state for `target`, or None (absent, unreadable, or another target's)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None
    header = (data.get("format"), data.get("version")) if isinstance(data, dict) else None
    if header != (FORMAT, VERSION):
        log.warning("ignoring %s: not a %s v%d file", path, FORMAT, VERSION)
        return None
    if data.get("target") != _target_id(target):
        log.warning("ignoring %s: learnt on another file named %s", path, target.name)
        return None
    return data


def restore(rt: Learner, data: dict[str, Any]) -> dict[str, int]:
    """Apply a saved state to a fresh runtime; returns what was taken, for the log."""
    pool = set(rt.manifests)

    def known(key: str) -> bool:
        return key.split("/")[0] in pool

    taken = {"estimates": rt.estimator.restore(data.get("estimator", {}), known)}
    for name, counts in data.get("rule_estimators", {}).items():
        if name in rt.scheduler.names:
            est = rt.scheduler.rule_estimators.setdefault(name, rt.new_estimator())
            taken["estimates"] += est.restore(counts, known)
    try:
        learnt = AcceptancePredictor.from_dict(data["predictor"])
    except (KeyError, TypeError, ValueError) as e:
        log.warning("not restoring the predictor's online weights: %s", e)
    else:
        keys = {k: m for k, m in learnt.keys.items() if known(k)}
        rt.scheduler.predictor.keys.update(keys)
        taken["predictor_keys"] = len(keys)
    return taken


class Memory:
    """The runtime's handle on its file for `target`: restore at start, save when it closes
    and, while it serves, at most every SAVE_EVERY_S after a request."""

    def __init__(self, rt: Learner, state_dir: Path, target: Path):
        self.rt = rt
        self.target = target
        self.path = learned_path(state_dir, target)
        self._saved_at = time.monotonic()
        self.data = read(self.path, target)

    @property
    def resident(self) -> list[str]:
        """Drafts resident when the last runtime stopped (known to this pool)."""
        ids = self.data.get("resident", []) if self.data else []
        return [i for i in ids if isinstance(i, str) and i in self.rt.manifests]

    def restore(self) -> None:
        if self.data is None:
            return
        taken = restore(self.rt, self.data)
        log.info("warm start from %s (saved %s): %s", self.path, self.data.get("saved"), taken)

    def request_done(self) -> None:
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        self._saved_at = time.monotonic()
        save(self.rt, self.target, self.path)
