"""What the standard library gained after Python 3.10, for the 3.10 that JetPack 6 ships.

A leaf: it imports nothing of memspec. `scripts/test.sh` runs vermin (`-t=3.10-`) over the
package, the tests and scripts/, so a 3.11-only name used anywhere else fails CI; use these.

- `tomllib`: the standard one on 3.11+, else the `tomli` backport (a dependency on < 3.11; same
  API: `load`, `loads`, `TOMLDecodeError`).
- `StrEnum`: an enum whose members are strings and print as their value, as 3.11's
  `enum.StrEnum`: `str(m)`, `f"{m}"` and `format(m)` are `m.value` on every version (a plain
  `class X(str, Enum)` formats as "X.NAME" on 3.12+ and str() is "X.NAME" everywhere).
- `name_os_thread`: the calling thread's name as the kernel shows it (`top -H`, `ps -L`,
  /proc/PID/task/TID/comm), as 3.14's threading does by itself. Threads started later by this
  one (llama.cpp's workers) inherit it, so a thread's CPU time is told apart by its role.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from enum import Enum

try:
    import tomllib  # novermin (the 3.10 fallback is below)
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["StrEnum", "name_os_thread", "tomllib"]


class StrEnum(str, Enum):
    """3.11's `enum.StrEnum` as far as memspec uses it: string members that print as their
    value. (Members compare, hash and JSON-encode as the string already: they are str.)"""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    # auto() gives the lower-cased name, as enum.StrEnum's does (a plain function, as there).
    def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
        return name.lower()


_PR_SET_NAME = 15  # prctl(2); the kernel keeps 15 bytes of the name


def name_os_thread(name: str) -> None:
    """Name the calling thread for the kernel (Linux; elsewhere, and on failure, nothing)."""
    if not sys.platform.startswith("linux") or sys.version_info >= (3, 14):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name is a convenience for ps/top: never worth failing a thread for
