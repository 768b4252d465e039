"""The value-per-byte fill: which drafts a memory budget holds.

One greedy rule for every working set (the live one, the simulator's, the memory planner's
and the MemSpec policy's plan), so that they agree on what a budget holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

K = TypeVar("K")  # what names an item to the caller (a draft id)


def fill_by_value(
    items: Iterable[tuple[K, float, int]], room: int, top_first: bool = False
) -> list[K]:
    """Of the (key, value, bytes) items worth something, the densest first while they fit in
    `room` (weightless ones are densest); ties keep the items' order.

    top_first: the most valuable item that fits goes in first. Only one draft runs per round,
    so holding two is worth about the better one: a dense small draft must not crowd the best
    one out of a one-draft budget."""
    fits = [x for x in items if x[1] > 0 and x[2] <= room]
    chosen: list[K] = []
    if top_first and fits:
        key, _, size = fits.pop(max(range(len(fits)), key=lambda i: fits[i][1]))
        chosen.append(key)
        room -= size
    for key, _, size in sorted(fits, key=lambda x: density(x[1], x[2]), reverse=True):
        if size <= room:
            chosen.append(key)
            room -= size
    return chosen


def density(value: float, size: int) -> float:
    """Value per byte."""
    return math.inf if size == 0 else value / size
