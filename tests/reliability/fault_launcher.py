"""`memspec serve` with faults injected on purpose: tests/server/fault_serve.py's engine faults
(FAULT:raise, FAULT:midstream, FAULT:slow, FAULT:hang in a prompt; FAULT_LOAD_DELAY_S) plus one
more, for the reliability tests only:

    a draft load that raises: while the file <MEMSPEC_DATA_DIR>/fault-raise-<draft id> exists,
    loading that draft raises RuntimeError inside the real loader (the test creates and removes
    the file while the daemon runs).

Everything else is the real daemon.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))

import fault_serve  # noqa: E402,F401 - applies the engine faults

import memspec.drafts.registry as registry  # noqa: E402
import memspec.runtime  # noqa: E402,F401 - imports every module that binds `instantiate`
from memspec.paths import data_dir  # noqa: E402

_instantiate = registry.instantiate


def instantiate(m, options, backend_kind):  # noqa: ANN001, ANN201 - a patch
    if (data_dir() / f"fault-raise-{m.id}").exists():
        raise RuntimeError(f"injected draft load fault ({m.id})")
    return _instantiate(m, options, backend_kind)


# Rebind the name wherever it was imported (the runtime or the scheduler's draft source).
for module in list(sys.modules.values()):
    if getattr(module, "instantiate", None) is _instantiate:
        module.instantiate = instantiate  # type: ignore[attr-defined]

if __name__ == "__main__":
    from memspec.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
