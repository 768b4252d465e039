"""Transparent huge pages for the memory llama.cpp allocates (Linux, glibc 2.35+).

A model loaded into process memory (use_mmap off: its residency is real) sits on 4 KiB pages,
and a decode step streams every weight through the TLB. On the 2-core EPYC box, one process,
the three alternating: SmolLM2-135M F32 decoded a token in 23.8 ms on 4 KiB pages, 22.7 ms
from an mmap of the file (llama-server's default) and 19.6 ms on 2 MiB pages; Qwen2.5-Coder
1.5B Q4_K_M (repacked) in 49.0, 46.1 and 45.5 ms.

The kernel's THP mode is commonly `madvise`: pages are huge only where a process asks, and
llama.cpp's buffers come from malloc, which does not ask. glibc's tunable
`glibc.malloc.hugetlb=1` makes malloc advise MADV_HUGEPAGE on the memory it maps, so a buffer
is faulted in on huge pages as llama.cpp fills it: nothing copied, no load time added. Tunables
are read when a process starts, so the `memspec` command starts itself again with it set
(`reexec_with_huge_pages`, before anything is loaded). Advising after the load instead
(MADV_COLLAPSE over the filled spans) was measured too: the same step time, but 2.6 s per GiB
added to every load. A GLIBC_TUNABLES that already names `glibc.malloc.hugetlb` is left as it
is: `glibc.malloc.hugetlb=0` turns this off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
REEXEC_MARK = "MEMSPEC_REEXEC"  # set in the restarted process: never restart twice


def thp_mode() -> str | None:
    """The kernel's THP mode (always, madvise, never), None where there is none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, OSError, ValueError):  # not glibc (musl, macOS)
        return None


def huge_page_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to start again with so that malloc asks for huge pages, or None when
    there is nothing to do: not Linux with glibc 2.35+ and THP in madvise mode (`always`
    needs no asking, `never` gives none), the tunable already named, or already restarted."""
    if sys.platform != "linux" or env.get(REEXEC_MARK) or TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return None
    if thp_mode() != "madvise" or (glibc_version() or (0, 0)) < (2, 35):
        return None
    tunables = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), f"{TUNABLE}=1") if t)
    return {**env, "GLIBC_TUNABLES": tunables, REEXEC_MARK: "1"}


def reexec_with_huge_pages() -> None:
    """Start this `memspec` command again, same arguments, with malloc on huge pages (see
    the module docstring); returns only when there is nothing to do."""
    env = huge_page_env(dict(os.environ))
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "memspec.cli", *sys.argv[1:]], env)


def malloc_asks_for_huge_pages() -> bool:
    """Whether this process's malloc advises huge pages (glibc.malloc.hugetlb=1 or 2)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return any(t in (f"{TUNABLE}=1", f"{TUNABLE}=2") for t in tunables)


def huge_page_bytes() -> int | None:
    """Anonymous memory of this process on transparent huge pages (smaps_rollup), or None."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError):
        return None
    return None
