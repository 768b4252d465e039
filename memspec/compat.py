"""What the standard library gained after Python 3.10, for the 3.10 that JetPack 6 ships.

A leaf: it imports nothing of memspec. `scripts/test.sh` runs vermin (`-t=3.10-`) over the
package, the tests and scripts/, so a 3.11-only name used anywhere else fails CI; use these.

- `tomllib`: the standard one on 3.11+, else the `tomli` backport (a dependency on < 3.11; same
  API: `load`, `loads`, `TOMLDecodeError`).
- `StrEnum`: an enum whose members are strings and print as their value, as 3.11's
  `enum.StrEnum`: `str(m)`, `f"{m}"` and `format(m)` are `m.value` on every version (a plain
  `class X(str, Enum)` formats as "X.NAME" on 3.12+ and str() is "X.NAME" everywhere).
"""

from __future__ import annotations

from enum import Enum

try:
    import tomllib  # novermin (the 3.10 fallback is below)
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["StrEnum", "tomllib"]


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
