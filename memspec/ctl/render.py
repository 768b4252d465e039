"""Human output of `memspec-ctl`: aligned tables and one-line summaries."""

from __future__ import annotations

import json
import time
from typing import Any

from memspec.units import format_size


def _size(n: Any) -> str:
    return format_size(int(n)) if isinstance(n, int | float) else "-"


def _pct(part: Any, whole: Any) -> str:
    if isinstance(part, int | float) and isinstance(whole, int | float) and whole > 0:
        return f" ({100 * part / whole:.0f}%)"
    return ""


def _yes(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _num(v: Any, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "-"


def _duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "-"
    s = int(s)
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Aligned columns; indexes in `right` are right-aligned (numbers)."""
    right = right or set()
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def kv_table(pairs: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)


def drafts_table(drafts: list[dict[str, Any]]) -> str:
    if not drafts:
        return "(no drafts)"
    rows = [
        [
            str(d.get("id", "?")),
            str(d.get("kind", "-")),
            _size(d.get("bytes")),
            _yes(d.get("resident")),
            _yes(d.get("pinned")),
            _num(d.get("acceptance")),
            _num(d.get("value")),
            _num(d.get("requests"), "d"),
        ]
        for d in drafts
    ]
    # VALUE: what the policy's last plan predicted holding the draft is worth (0: not wanted).
    headers = ["DRAFT", "KIND", "SIZE", "RESIDENT", "PINNED", "ACCEPT", "VALUE", "REQUESTS"]
    out = table(headers, rows, right={2, 5, 6, 7})
    # Drafts left out of the pool because they speak another tokenizer than the target.
    refused = [d for d in drafts if d.get("compatible") is False]
    if refused:
        out += "\n\nnot usable with this target (tokenizer):"
        out += "".join(f"\n  {d.get('id', '?')}: {d.get('reason') or '-'}" for d in refused)
    return out


def _memory_lines(mem: Any) -> list[tuple[str, str]]:
    """What the telemetry snapshot says, when the daemon includes it (tolerant of shape)."""
    if not isinstance(mem, dict):
        return []
    out = []
    system = mem.get("system") or {}
    if system.get("available_bytes") is not None:
        out.append(
            (
                "system",
                f"{_size(system['available_bytes'])} available of "
                f"{_size(system.get('total_bytes'))}",
            )
        )
    proc = mem.get("process") or {}
    if proc.get("rss_bytes") is not None:
        uss = f", USS {_size(proc['uss_bytes'])}" if proc.get("uss_bytes") is not None else ""
        out.append(("process", f"RSS {_size(proc['rss_bytes'])}{uss}"))
    jetson = mem.get("jetson")
    if isinstance(jetson, dict):
        jp = f", JetPack {jetson['jetpack']}" if jetson.get("jetpack") else ""
        model = f", {jetson['model']}" if jetson.get("model") else ""
        out.append(("jetson", f"L4T {jetson.get('l4t', '?')}{jp}{model}"))
    if mem.get("nvmap_used_bytes") is not None:
        out.append(("nvmap", f"{_size(mem['nvmap_used_bytes'])} used (GPU, shared DRAM)"))
    cuda = mem.get("cuda")
    if isinstance(cuda, dict) and cuda.get("total_bytes"):
        out.append(
            ("cuda", f"{_size(cuda.get('free_bytes'))} free of {_size(cuda['total_bytes'])}")
        )
    return out


def status(st: dict[str, Any], url: str, prev: dict[str, Any] | None = None) -> str:
    budget = st.get("budget_bytes")
    used = st.get("used_bytes") or {}
    if not isinstance(used, dict):  # a plain number: treat it as measured
        used = {"measured": used}
    queue = st.get("queue") or {}
    slots = st.get("slots") or {}
    served = st.get("requests_served")
    delta = ""
    if (
        prev is not None
        and isinstance(served, int)
        and isinstance(prev.get("requests_served"), int)
    ):
        delta = f" (+{served - prev['requests_served']})"
    backend = f" ({st['backend']})" if st.get("backend") else ""
    pairs = [
        (
            "daemon",
            f"{url}  {st['state'] + ', ' if st.get('state') else ''}"
            f"version {st.get('version', '?')}, up {_duration(st.get('uptime_s'))}",
        ),
        ("target", f"{st.get('model') or '-'}{backend}"),
        ("chat", str((st.get("chat_template") or {}).get("source") or "-")),
        ("policy", f"{st.get('policy', '-')}   k_max {st.get('k_max', '-')}"),
        ("n_ctx", f"{st.get('n_ctx', '-')}{_kv_text(st.get('kv_cache'))}"),
        *_context_lines((st.get("working_set") or {}).get("context")),
        ("budget", _size(budget)),
        (
            "used",
            f"measured {_size(used.get('measured'))}{_pct(used.get('measured'), budget)}   "
            f"modelled {_size(used.get('modelled'))}{_pct(used.get('modelled'), budget)}",
        ),
        *_memory_lines(st.get("memory")),
        ("queue", f"{queue.get('depth', '-')} / {queue.get('max', '-')}"),
        ("slots", f"{slots.get('active', '-')} / {slots.get('total', '-')} active"),
        *_device_lines(st.get("devices") or []),
        ("requests", f"{served if served is not None else '-'}{delta}"),
        ("tok/s", f"{_num(st.get('tokens_per_s_recent'), '.1f')} (recent)"),
        *_model_lines(st.get("models") or [], st.get("residency")),
        # Models-dir files not served: the operator sees why (the daemon serves the rest).
        *[("bad file", f"{b.get('file')}: {b.get('reason')}") for b in st.get("bad_models") or []],
        *_build_lines(st.get("draft_builds") or []),
    ]
    return kv_table(pairs) + "\n\n" + drafts_table(st.get("drafts") or [])


def _model_lines(models: list[dict[str, Any]], residency: str | None) -> list[tuple[str, str]]:
    """Every servable model: resident ones with their bytes and keep_alive expiry."""
    lines = []
    for m in models:
        mark = " (default)" if m.get("default") else ""
        if m.get("resident"):
            exp = m.get("expires_at")
            until = "no expiry" if exp is None else f"expires in {_duration(exp - time.time())}"
            state = f"resident {_size(m.get('bytes'))}, {until}"
            if m.get("calibration") == "calibrating":  # plain decoding till it lands
                state += ", calibrating"
        else:
            state = "not loaded"
        counts = f"loads {m.get('loads', 0)}, evictions {m.get('evictions', 0)}"
        lines.append(("model", f"{m.get('name')}{mark}: {state}; {counts}"))
    if lines and residency:
        lines.insert(0, ("residency", residency))
    return lines


def _build_lines(builds: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each model's background draft build: queued, building, built (with what) or failed
    (with why): a failed build leaves the model serving with prompt lookup."""
    lines = []
    for b in builds:
        names = ", ".join(b.get("models") or []) or str(b.get("key"))
        state = str(b.get("state"))
        if state == "built":
            drafts = list(b.get("drafts") or [])
            if b.get("sibling") and b["sibling"] not in drafts:
                drafts.append(str(b["sibling"]))
            state += f": {', '.join(drafts) or 'nothing to build'}"
        elif state == "failed":
            state += f": {b.get('reason') or '-'}"
        lines.append(("drafts build", f"{names}: {state}"))
    return lines


def _context_lines(ctx: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The trade beside n_ctx: context per slot against the drafts resident and the slots."""
    if not ctx or not ctx.get("n_ctx"):
        return []
    slots = ctx.get("slots", 1)
    drafts = ", ".join(ctx.get("drafts") or []) or "no draft"
    how = "auto" if ctx.get("auto") else f"auto would give {ctx.get('longest', 0):,}"
    return [
        (
            "context",
            f"{ctx['n_ctx']:,} per slot x {slots} slot{'s' if slots != 1 else ''} beside "
            f"{drafts} ({_size(ctx.get('drafts_bytes'))}); {how}, "
            f"limit {ctx.get('limited_by', '-')} (trained {ctx.get('trained_context', 0):,}); "
            f"{ctx.get('without_drafts', 0):,} with no draft",
        )
    ]


def _device_lines(devices: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A target split over RPC workers: one line per device (layers, bytes, state)."""
    if len(devices) < 2:
        return []
    lines = []
    for d in devices:
        state = f"   {d['state']}" if d.get("state") else ""
        layers = f"{d['layers']} layers, " if "layers" in d else ""
        lines.append(("device", f"{d['device']}: {layers}{_size(d.get('bytes'))}{state}"))
    return lines


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def draft_action(action: str, draft: dict[str, Any]) -> str:
    done = {"load": "loaded", "evict": "evicted", "pin": "pinned", "unpin": "unpinned"}
    return (
        f"{done[action]} {draft.get('id')}: {_size(draft.get('bytes'))}, "
        f"resident {_yes(draft.get('resident'))}, pinned {_yes(draft.get('pinned'))}"
    )


def tune(field: str, value: Any, settings: dict[str, Any]) -> str:
    pairs = []
    for k, v in settings.items():
        shown = f"{_size(v)} ({v})" if k in ("budget", "budget_bytes") and isinstance(v, int) else v
        pairs.append((k, str(shown)))
    out = f"set {field} = {value}"
    return out + "\n" + kv_table(pairs) if pairs else out


def bench(rep: dict[str, Any]) -> str:
    head = (
        f"bench  {rep['requests']} requests, concurrency {rep['concurrency']}, "
        f"max_tokens {rep['max_tokens']}, model {rep['model']}, {rep['wall_s']:.2f} s\n"
        f"ok {rep['ok']}   429 {rep['rejected_429']}   errors {rep['errors']}   "
        f"unfinished {rep['unfinished']}   tokens {rep['tokens']}   "
        f"throughput {_num(rep['throughput_tokens_per_s'], '.1f')} tok/s"
    )

    def row(name: str, d: dict[str, Any], scale: float, fmt: str) -> list[str]:
        return [name] + [
            _num(d[k] * scale if d[k] is not None else None, fmt)
            for k in ("p50", "p90", "p99", "mean")
        ]

    rows = [
        row("ttft (ms)", rep["ttft_s"], 1e3, ".1f"),
        row("latency (ms)", rep["latency_s"], 1e3, ".1f"),
        row("tok/s per request", rep["tokens_per_s"], 1.0, ".1f"),
    ]
    out = head + "\n\n" + table(["", "P50", "P90", "P99", "MEAN"], rows, right={1, 2, 3, 4})
    for e in rep["error_samples"]:
        out += f"\nerror: {e}"
    if rep["ok"] and not rep["tokens"]:
        out += "\nnote: no tokens generated (the model stopped at once); try another --prompt"
    return out


def _kv_text(kv: dict[str, Any] | None) -> str:
    """The KV cache types beside n_ctx: "   KV q8_0/q8_0, flash attention (drafts f16/f16)"."""
    if not kv:
        return ""
    text = f"   KV {kv['type_k']}/{kv['type_v']}"
    if kv.get("flash_attn"):
        text += ", flash attention"
    if kv.get("swa_full"):
        text += ", full-size sliding-window layers"
    if (kv.get("draft_type_k"), kv.get("draft_type_v")) != (kv["type_k"], kv["type_v"]):
        text += f" (drafts {kv.get('draft_type_k')}/{kv.get('draft_type_v')})"
    return text
