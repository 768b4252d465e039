"""The scheduling policies in the daemon: registered into Runtime.policies by name.

`memspec`, `ucb`, `exp3` and `fixed:<id>` (one per manifest) become selectable per daemon
(settings.policy) and per request (`policy=`). Each name has one instance per runtime, so
bandit statistics, the predictor's online learning and memspec's view of the workload carry
over from request to request. The predictor artifact comes from settings.predictor (default:
predictors/smollm2-mtbench.json); a missing or corrupt one is reported in the status and the
daemon decodes on with per-kind priors, still learning online. `oracle` needs traces and is a
benchmark-only policy (`memspec bench policies`).
"""

from __future__ import annotations

import logging
import re
import weakref
from pathlib import Path

from memspec.paths import DEFAULT_PREDICTOR
from memspec.predictor.model import AcceptancePredictor, load_or_fallback
from memspec.scheduler.policies import DraftInfo, Env, Policy, Request, make_policy
from memspec.scheduler.rounds import PolicyRounds

log = logging.getLogger(__name__)

DAEMON_POLICIES = ("memspec", "ucb", "exp3")
# Without a measured load yet, assume this many bytes per second (a conservative disk read).
FALLBACK_LOAD_BANDWIDTH = 500e6

_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Scheduling:
    """Per-runtime: the predictor, the draft view policies share, and policy instances."""

    def __init__(self, rt) -> None:
        path = getattr(rt.settings, "predictor", None)
        self.predictor_path = Path(path) if path else DEFAULT_PREDICTOR
        self.predictor: AcceptancePredictor = load_or_fallback(self.predictor_path)
        if self.predictor.error:
            log.warning("predictor: %s; using per-kind priors", self.predictor.error)
        self.env = Env({}, rt.costs, rt.settings.k_max)
        self.policies: dict[str, Policy] = {}
        self.refresh(rt)

    def refresh(self, rt) -> None:
        """Draft sizes and measured load times, as the working set knows them now."""
        rows = {r["id"]: r for r in rt.working_set.status()} if rt.working_set else {}
        for d, m in rt.manifests.items():
            row = rows.get(d, {})
            size = int(row.get("bytes") or 0)
            load_s = row.get("load_s")
            if load_s is None:
                load_s = size / FALLBACK_LOAD_BANDWIDTH
            self.env.drafts[d] = DraftInfo(d, m.kind, size, float(load_s))
        self.env.costs = rt.costs

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            self.policies[name] = make_policy(name, self.env, self.predictor)
        return self.policies[name]


def scheduling(rt) -> _Scheduling:
    s = _state.get(rt)
    if s is None:
        s = _state[rt] = _Scheduling(rt)
    return s


def request_text(rt, prompt: list[int]) -> tuple[str, int]:
    """The last user message and the number of user turns, read back from the prompt (ChatML
    templates; anything else: the whole prompt, one turn)."""
    text = rt.target.detokenize(prompt).decode("utf-8", errors="replace")
    turns = len(re.findall(r"<\|im_start\|>user", text))
    if turns:
        last = text.rsplit("<|im_start|>user", 1)[1]
        return last.split("<|im_end|>", 1)[0].strip(), turns
    return text, 1


def _factory(name: str):
    def build(rt, req) -> PolicyRounds:
        s = scheduling(rt)
        s.refresh(rt)
        text, turns = request_text(rt, req.prompt)
        request = Request("", req.prompt, text, turns, req.params.max_tokens)
        return PolicyRounds(s.policy(name), rt.working_set, request, rt.settings.k_max)

    return build


def register_policies(rt) -> None:
    """Add memspec, ucb, exp3 and fixed:<id> to rt.policies (the Runtime's policy seam)."""
    for name in DAEMON_POLICIES:
        rt.policies[name] = _factory(name)
    for d in rt.manifests:
        rt.policies[f"fixed:{d}"] = _factory(f"fixed:{d}")


def scheduling_status(rt) -> dict:
    """Policy state and predictor status for the daemon's status/admin output."""
    s = _state.get(rt)
    if s is None:
        if getattr(rt, "costs", None) is None:
            return {"predictor": None, "policies": {}}
        s = scheduling(rt)
    return {
        "predictor": s.predictor.describe(),
        "policies": {n: p.status() for n, p in s.policies.items()},
    }
