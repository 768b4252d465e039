"""`memspec-ctl`: inspect and steer a running MemSpec daemon through its admin API.

    memspec-ctl [--url URL] [--key KEY] [--timeout S] COMMAND
      status [--json]                        budget, used bytes, policy, target, drafts, tok/s
      drafts list [--json]                   the draft pool and what is resident
      drafts load|evict|pin|unpin ID [--json]
      tune budget SIZE | policy NAME | k-max N | n-ctx N [--json]   applied live, persisted
      reset [--json]                         undo every tune: the configured settings again
      watch [--interval S] [--count N]       live status view (Ctrl-C to quit)
      bench [--requests N] [--concurrency C] [--max-tokens M] [--prompt P ...] [--json]

--url defaults to $MEMSPEC_URL or http://127.0.0.1:8000, --key to $MEMSPEC_ADMIN_KEY (sent as
`Authorization: Bearer KEY` to /admin). bench talks to /v1 with --api-key ($MEMSPEC_API_KEY),
else the admin key.

Exit status: 0 ok; 1 the daemon answered with an error (unknown draft, bad setting, 5xx) or
bench requests failed; 2 usage error, nothing sent (bad argument, bad size, bad URL);
3 daemon unreachable (refused, timed out, not ready); 4 unauthorized (401/403).
Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

from memspec.config import client_env
from memspec.ctl import render
from memspec.ctl.client import (
    EXIT_OK,
    EXIT_SERVER,
    EXIT_USAGE,
    Client,
    CtlError,
    one_line,
    run_bench,
)
from memspec.kv_cache import KV_TYPES
from memspec.net import is_loopback
from memspec.units import parse_size

DEFAULT_URL = "http://127.0.0.1:8000"
# A plain continuation: an instruct model given a question as a raw completion prompt often
# stops at once, which would measure nothing.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived"

# bench is a load generator on a small device: keep it bounded so a typo cannot turn it into
# a denial of service of the daemon (or of someone else's, hence loopback only).
BENCH_MAX_REQUESTS = 1000
BENCH_MAX_CONCURRENCY = 64
BENCH_MAX_TOKENS = 4096
BENCH_MAX_TIME_S = 600.0


# --- commands ----------------------------------------------------------------------------


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    st = client.get("/admin/status")
    if args.json:
        render.print_json(st)
    else:
        print(render.status(st, client.url))
    return EXIT_OK


def cmd_drafts(client: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        data = client.get("/admin/drafts")
        if args.json:
            render.print_json(data)
        else:
            print(render.drafts_table(data.get("drafts") or []))
        return EXIT_OK
    data = client.post(f"/admin/drafts/{quote(args.id, safe='')}/{args.action}", {})
    if args.json:
        render.print_json(data)
        return EXIT_OK
    print(render.draft_action(args.action, {"id": args.id} | (data.get("draft") or {})))
    return EXIT_OK


def cmd_tune(client: Client, args: argparse.Namespace) -> int:
    data = client.post("/admin/tune", {args.field: args.value})
    if args.json:
        render.print_json(data)
    else:
        print(render.tune(args.field, args.value, data.get("settings") or {}))
    return EXIT_OK


def cmd_reset(client: Client, args: argparse.Namespace) -> int:
    data = client.post("/admin/reset", {})
    if args.json:
        render.print_json(data)
    else:
        changed = ", ".join(data.get("reset") or []) or "nothing was tuned"
        print(
            render.tune("configured settings", f"restored ({changed})", data.get("settings") or {})
        )
    return EXIT_OK


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    prev: dict[str, Any] | None = None
    rc = EXIT_OK
    n = 0
    try:
        while True:
            stamp = time.strftime("%H:%M:%S")
            try:
                st = client.get("/admin/status")
                body, rc = render.status(st, client.url, prev), EXIT_OK
                prev = st
            except CtlError as e:
                body, rc = f"(no status: {e.message})", e.code
                print(f"memspec-ctl: error: {e.message}", file=sys.stderr)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
            elif n:
                print()
            print(f"--- {stamp}  every {args.interval:g}s  (Ctrl-C to quit) ---")
            print(body, flush=True)
            n += 1
            if args.count is not None and n >= args.count:
                return rc
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return rc


def cmd_bench(client: Client, args: argparse.Namespace) -> int:
    host = urlsplit(client.url).hostname or ""
    if not is_loopback(host):
        raise CtlError(
            f"bench runs only against a daemon on this machine (loopback), not {host!r}",
            EXIT_USAGE,
        )
    rep = asyncio.run(
        run_bench(
            client.url,
            args.api_key or client.key,
            requests=args.requests,
            concurrency=min(args.concurrency, args.requests),
            max_tokens=args.max_tokens,
            prompts=args.prompt or [DEFAULT_PROMPT],
            time_limit=args.time_limit,
            timeout=client.timeout,
            model=args.model,
            draft=args.draft,
        )
    )
    if args.json:
        render.print_json(rep)
    else:
        print(render.bench(rep))
    failed = rep["errors"] + rep["unfinished"]
    if failed or rep["ok"] == 0:
        why = rep["error_samples"][0] if rep["error_samples"] else None
        if rep["unfinished"]:
            why = f"time limit {args.time_limit:g}s reached"
        elif why is None and rep["rejected_429"]:
            why = "every request was rejected with 429 (queue full)"
        raise CtlError(f"bench: {failed or rep['requests']} of {rep['requests']} failed ({why})")
    return EXIT_OK


# --- argument parsing --------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus exit 2), like every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def _bounded(kind: type, lo: float, hi: float | None = None):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            limit = f"between {lo:g} and {hi:g}" if hi is not None else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {limit}: {text!r}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _choice(names: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(names)}: {text!r}")
        return text

    parse.__name__ = "choice"
    return parse


def _on_off(text: str) -> bool:
    """on / off (also true / false): the admin API's boolean."""
    if text.lower() not in ("on", "off", "true", "false"):
        raise argparse.ArgumentTypeError(f"on or off: {text!r}")
    return text.lower() in ("on", "true")


def _n_ctx_arg(text: str) -> int | str:
    """auto, or a context length of at least 16 tokens."""
    return "auto" if text == "auto" else _bounded(int, 16, 1 << 20)(text)


def _size_arg(text: str) -> int | str:
    """Validated here (nothing is sent on a typo); sent as the user wrote it so the daemon
    persists '1.5GiB' rather than 1610612736."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"budget must be > 0: {text!r}")
    return int(text) if text.strip().isdigit() else text.strip()


def _url_arg(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"not an http(s) URL: {text!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in URL: {text!r}") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="memspec-ctl",
        description="Inspect and steer a running MemSpec daemon.",
        epilog="Exit status: 0 ok, 1 daemon error, 2 usage, 3 unreachable, 4 unauthorized.",
    )
    env = client_env(DEFAULT_URL)
    p.add_argument(
        "--url",
        type=_url_arg,
        default=env["url"],
        help="daemon URL (env MEMSPEC_URL, default %(default)s)",
    )
    p.add_argument(
        "--key",
        default=env["admin_key"],
        help="admin key, sent as a bearer token (env MEMSPEC_ADMIN_KEY)",
    )
    p.add_argument(
        "--api-key",
        default=env["api_key"],
        help="key for /v1 (bench; env MEMSPEC_API_KEY; default: the admin key)",
    )
    p.add_argument(
        "--timeout",
        type=_bounded(float, 0.1, 3600),
        default=10.0,
        help="seconds per HTTP request (default %(default)s)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("status", help="budget, memory, policy, drafts, throughput")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("drafts", help="list, load, evict, pin or unpin drafts")
    dsub = d.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = dsub.add_parser("list", help="the draft pool")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_drafts)
    for action, help_ in (
        ("load", "make a draft resident now"),
        ("evict", "drop a resident draft"),
        ("pin", "keep a draft resident (never evicted)"),
        ("unpin", "let the scheduler evict it again"),
    ):
        a = dsub.add_parser(action, help=help_)
        a.add_argument("id", help="draft id (see `drafts list`)")
        a.add_argument("--json", action="store_true")
        a.set_defaults(func=cmd_drafts)

    t = sub.add_parser("tune", help="change a setting live (the daemon persists it)")
    tsub = t.add_subparsers(dest="setting", required=True, metavar="SETTING")
    for name, field, kind, help_ in (
        ("budget", "budget", _size_arg, "memory budget, e.g. 1.5GiB, 800MB, 123456"),
        ("policy", "policy", str, "policy name"),
        ("k-max", "k_max", _bounded(int, 0, 64), "longest draft per round (0: no drafting)"),
        ("n-ctx", "n_ctx", _n_ctx_arg, "context per slot in tokens, or auto (the budget's)"),
        ("prefill-chunk", "prefill_chunk", _bounded(int, 16, 1 << 16), "prompt tokens a round"),
        (
            "context-overflow",
            "context_overflow",
            _choice(("error", "shift")),
            "a chat over the context: error (400) or shift (drop its oldest turns)",
        ),
        ("parallel", "parallel", _bounded(int, 0, 64), "sequence slots (0: what the budget fits)"),
        ("kv-type-k", "kv_type_k", _choice(KV_TYPES), "the target's K cache type"),
        ("kv-type-v", "kv_type_v", _choice(KV_TYPES), "the target's V cache type"),
        ("draft-kv-type-k", "draft_kv_type_k", _choice(KV_TYPES), "model drafts' K cache type"),
        ("draft-kv-type-v", "draft_kv_type_v", _choice(KV_TYPES), "model drafts' V cache type"),
        ("flash-attn", "flash_attn", _choice(("auto", "on", "off")), "flash attention"),
        (
            "swa-full",
            "swa_full",
            _on_off,
            "on: sliding-window layers keep the whole context (off: the window, less memory)",
        ),
    ):
        a = tsub.add_parser(name, help=help_)
        a.add_argument("value", type=kind, metavar=name.upper().replace("-", "_"))
        a.add_argument("--json", action="store_true")
        a.set_defaults(func=cmd_tune, field=field)

    r = sub.add_parser("reset", help="undo every tune: the configured settings, live and at start")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_reset)

    w = sub.add_parser("watch", help="live status view")
    w.add_argument("--interval", type=_bounded(float, 0.1), default=2.0, help="seconds (default 2)")
    w.add_argument("--count", type=_bounded(int, 1), help="stop after N refreshes")
    w.set_defaults(func=cmd_watch)

    b = sub.add_parser("bench", help="short streaming load against a local daemon")
    b.add_argument("--requests", type=_bounded(int, 1, BENCH_MAX_REQUESTS), default=8)
    b.add_argument("--concurrency", type=_bounded(int, 1, BENCH_MAX_CONCURRENCY), default=2)
    b.add_argument("--max-tokens", type=_bounded(int, 1, BENCH_MAX_TOKENS), default=64)
    b.add_argument(
        "--prompt", action="append", help="prompt (repeatable; requests cycle through them)"
    )
    b.add_argument("--model", help="model id (default: the first in /v1/models)")
    b.add_argument("--draft", help="request field `draft`: an id, none or auto")
    b.add_argument(
        "--time-limit",
        type=_bounded(float, 1, BENCH_MAX_TIME_S),
        default=120.0,
        help="stop after this many seconds; unfinished requests count as failures",
    )
    b.add_argument("--json", action="store_true", help="JSON report with every request")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.url, args.key, args.timeout) as client:
            return args.func(client, args)
    except CtlError as e:
        print(f"memspec-ctl: error: {e.message}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `memspec-ctl status | head`: nothing left to say
        # Point stdout at /dev/null so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # a bug or an odd answer: still one line, never a traceback
        msg = one_line(str(e))
        print(f"memspec-ctl: error: unexpected {type(e).__name__}: {msg}", file=sys.stderr)
        return EXIT_SERVER
