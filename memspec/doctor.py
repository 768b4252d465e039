"""Which kernels run: the llama.cpp build, the CPU features it uses, and how setup proved it.

`scripts/llama_build.py` leaves `.memspec-llama.json` in the virtualenv: the CMake flags the
installed library was built with, why a fallback build was chosen (e.g. the native build died
with SIGILL in an AMX path) and what each model kind did under the probe. `memspec doctor`
prints this report and the daemon puts it in `/admin/status` under `kernels`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from memspec.memory.huge_pages import malloc_asks_for_huge_pages, thp_mode

BUILD_STAMP = Path(sys.prefix) / ".memspec-llama.json"


def parse_system_info(info: str) -> dict[str, list[str]]:
    """llama.cpp's "CPU : SSE3 = 1 | AVX2 = 1 | ... | LLAMAFILE = 0 |" -> backend -> features on."""
    backends: dict[str, list[str]] = {}
    for section in info.split("|"):
        part = section.strip()
        if " : " in part:  # a new backend starts: "CPU : SSE3 = 1"
            name, part = (s.strip() for s in part.split(" : ", 1))
            backends.setdefault(name, [])
        if part.endswith("= 1") and backends:
            backends[list(backends)[-1]].append(part.split("=")[0].strip())
    return backends


def kernel_report() -> dict[str, Any]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    try:
        build = json.loads(BUILD_STAMP.read_text())
    except (OSError, ValueError):
        build = None  # installed by hand, not by scripts/setup.sh
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "features": parse_system_info(info),
        "batch_invariant": "LLAMAFILE = 1" not in info,
        "build": build,
        # Whether llama.cpp's buffers go on transparent huge pages (memory/huge_pages.py).
        "huge_pages": {"thp": thp_mode(), "malloc_hugetlb": malloc_asks_for_huge_pages()},
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"llama-cpp-python {report['llama_cpp_python']}"]
    for backend, features in report["features"].items():
        lines.append(f"  {backend}: {' '.join(features) or '(baseline)'}")
    lines.append(f"  batch-invariant kernels: {'yes' if report['batch_invariant'] else 'no'}")
    pages = report["huge_pages"]
    asks = "yes" if pages["malloc_hugetlb"] else "no"
    lines.append(f"  huge pages: THP {pages['thp'] or 'not available'}, malloc asks: {asks}")
    build = report["build"]
    if build is None:
        lines.append("  build: not made by scripts/setup.sh (no probe on record)")
        return "\n".join(lines)
    lines.append(f"  CMAKE_ARGS: {build['cmake_args'].strip() or '(none)'}")
    if build.get("fallback_reason"):
        lines.append(f"  fallback build, because: {build['fallback_reason']}")
    probe = build.get("probe") or {}
    runs = ", ".join(f"{kind} {result}" for kind, result in probe.items())
    lines.append(f"  probe: {runs or 'not run'}")
    return "\n".join(lines)
