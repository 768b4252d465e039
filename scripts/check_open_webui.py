"""Drive Open WebUI in headless Chromium against memspec's Ollama API (issue 37).

Run by scripts/check_open_webui.sh with the Open WebUI venv's python (Playwright lives there,
not in the project's .venv). Both servers must already be up; this script only looks.

Steps, each recorded pass/fail in a JSON summary printed on stdout (and written to --summary):
  memspec_tags    memspec's own /api/tags: the names Open WebUI should show
  ui_open         the UI loads with auth off and a chat input
  models_listed   Open WebUI's /api/models and its model selector hold every memspec model
  model_details   the selector shows /api/tags details (parameter size, quantization, size);
                  Open WebUI's /ollama/api/show proxy returns memspec's /api/show
  model_selected  the model is picked in the selector
  chat_streamed   a chat answer appears and grows over several observations (streamed)
  access_log      every request Open WebUI made to memspec got a 2xx (needs --memspec-log)
Exit status 0 only if every step passed; the last stderr line names the first failure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, WebSocket, sync_playwright

VIEWPORT = {"width": 1280, "height": 800}
PROMPT = "Write one short sentence about the sea."
# uvicorn's access line: 127.0.0.1:5000 - "POST /api/chat HTTP/1.1" 200 OK
ACCESS_RE = re.compile(r'"(GET|POST|HEAD|DELETE|PUT|PATCH|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


class StepFailed(Exception):
    pass


class Summary:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[[], dict[str, Any] | None]) -> bool:
        t0 = time.monotonic()
        row: dict[str, Any] = {"step": name}
        try:
            row.update(fn() or {})
            row["ok"] = True
        except Exception as exc:  # any failure is this step's outcome, not a crash
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        row["seconds"] = round(time.monotonic() - t0, 2)
        self.steps.append(row)
        print(
            f"[check] {name}: {'ok' if row['ok'] else 'FAILED: ' + row['error']}", file=sys.stderr
        )
        return bool(row["ok"])

    def first_failure(self) -> dict[str, Any] | None:
        return next((s for s in self.steps if not s["ok"]), None)


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def ui_fetch(page: Page, path: str, body: dict[str, Any] | None = None) -> Any:
    """Call Open WebUI's own API from the page, with the session's token, as its frontend does."""
    return page.evaluate(
        """async ([path, body]) => {
            const opts = {headers: {'Content-Type': 'application/json',
                                    Authorization: 'Bearer ' + localStorage.token}};
            if (body !== null) { opts.method = 'POST'; opts.body = JSON.stringify(body); }
            const r = await fetch(path, opts);
            const text = await r.text();
            let parsed = null;
            try { parsed = JSON.parse(text); } catch (e) {}
            const raw = parsed === null ? text.slice(0, 500) : null;
            return {status: r.status, json: parsed, text: raw};
        }""",
        [path, body],
    )


def dismiss_modals(page: Page) -> None:
    # First visit as admin shows the changelog ("What's New"); it covers the chat.
    btn = page.get_by_role("button", name="Okay, Let's Go!")
    try:
        btn.click(timeout=3000)
    except Exception:
        page.keyboard.press("Escape")


def open_selector(page: Page) -> None:
    if page.locator('button[role="option"]').count() == 0:
        page.locator('button[id^="model-selector-"][id$="-button"]').first.click()
        page.locator('button[role="option"]').first.wait_for(timeout=15000)


def close_selector(page: Page) -> None:
    if page.locator('button[role="option"]').count():
        page.keyboard.press("Escape")
        page.locator('button[role="option"]').first.wait_for(state="detached", timeout=5000)


def access_lines(log: Path | None, start: int) -> list[dict[str, Any]]:
    if log is None or not log.exists():
        return []
    out = []
    with log.open(errors="replace") as f:
        f.seek(start)
        for line in f:
            m = ACCESS_RE.search(line)
            if m:
                out.append({"method": m[1], "path": m[2], "status": int(m[3])})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ui", required=True, help="Open WebUI base URL")
    ap.add_argument("--memspec", required=True, help="memspec base URL (its Ollama API)")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", type=Path, default=Path("docs/img"), help="screenshot directory")
    ap.add_argument("--summary", type=Path, help="also write the JSON summary here")
    ap.add_argument("--memspec-log", type=Path, help="memspec's log, for its access lines")
    # A CPU box prefills Open WebUI's ~7k-token tool prompt for minutes.
    ap.add_argument("--answer-timeout", type=float, default=900)
    ap.add_argument("--label", default="", help="free text recorded in the summary")
    ap.add_argument("--shot-suffix", default="", help="added to each screenshot's name")
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_start = (
        args.memspec_log.stat().st_size if args.memspec_log and args.memspec_log.exists() else 0
    )

    s = Summary()
    s.data.update(
        label=args.label, ui=args.ui, memspec=args.memspec, prompt=args.prompt, screenshots=[]
    )
    expected: list[dict[str, Any]] = []

    def shot(page: Page, name: str) -> None:
        path = args.out / name.replace(".png", f"{args.shot_suffix}.png")
        page.screenshot(path=str(path))
        s.data["screenshots"].append(str(path))

    def memspec_tags() -> dict[str, Any]:
        tags = http_json(args.memspec.rstrip("/") + "/api/tags")
        expected.extend(tags["models"])
        if not expected:
            raise StepFailed("memspec /api/tags lists no model")
        version = http_json(args.memspec.rstrip("/") + "/api/version")
        return {"models": [m["name"] for m in expected], "version": version}

    if not s.run("memspec_tags", memspec_tags):
        return finish(s, args.memspec_log, log_start, args.summary)

    ws_frames: list[tuple[float, str]] = []

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=args.chromium, headless=True, args=["--no-sandbox"]
        )
        ctx = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
        page = ctx.new_page()
        console_errors: list[str] = []
        page.on(
            "console", lambda m: console_errors.append(m.text[:300]) if m.type == "error" else None
        )

        def on_ws(ws: WebSocket) -> None:
            # Open WebUI relays the answer's deltas to the page over socket.io.
            ws.on(
                "framereceived",
                lambda p: ws_frames.append((time.monotonic(), p if isinstance(p, str) else "")),
            )

        page.on("websocket", on_ws)
        names = [m["name"] for m in expected]
        target = expected[0]

        def ui_open() -> dict[str, Any]:
            page.goto(args.ui, wait_until="domcontentloaded", timeout=120000)
            page.locator("#chat-input").wait_for(timeout=120000)
            dismiss_modals(page)
            version = ui_fetch(page, "/api/version")
            user = ui_fetch(page, "/api/v1/auths/")
            return {
                "open_webui_version": (version["json"] or {}).get("version"),
                "user": (user["json"] or {}).get("email"),
                "role": (user["json"] or {}).get("role"),
            }

        if not s.run("ui_open", ui_open):
            shot(page, "open-webui-failed.png")
            browser.close()
            return finish(s, args.memspec_log, log_start, args.summary)

        def models_listed() -> dict[str, Any]:
            r = ui_fetch(page, "/api/models")
            if r["status"] != 200:
                raise StepFailed(
                    f"Open WebUI /api/models answered {r['status']}: {r['text'] or r['json']}"
                )
            ui_models = r["json"]["data"]
            ids = [m["id"] for m in ui_models]
            s.data["ui_models"] = [
                {
                    "id": m["id"],
                    "name": m.get("name"),
                    "owned_by": m.get("owned_by"),
                    "ollama": {
                        k: m.get("ollama", {}).get(k)
                        for k in ("details", "size", "digest", "expires_at")
                    },
                }
                for m in ui_models
            ]
            open_selector(page)
            options = page.locator('button[role="option"]')
            shown = [options.nth(i).get_attribute("data-value") for i in range(options.count())]
            missing = [n for n in names if n not in ids or n not in shown]
            shot(page, "open-webui-models.png")
            if missing:
                raise StepFailed(
                    f"missing from Open WebUI: {missing}; /api/models ids {ids}, selector {shown}"
                )
            return {"api_models": ids, "selector_options": shown}

        s.run("models_listed", models_listed)

        def model_details() -> dict[str, Any]:
            details = target.get("details") or {}
            open_selector(page)
            option = page.locator(f'button[role="option"][data-value="{target["name"]}"]')
            row_text = option.inner_text()
            want_size = str(details.get("parameter_size", ""))
            if not want_size or want_size not in row_text:
                raise StepFailed(f"selector row {row_text!r} lacks parameter_size {want_size!r}")
            # The parameter size's tooltip shows quantization and file size (ModelItem.svelte).
            option.get_by_text(want_size, exact=True).hover()
            tip = page.locator("[data-tippy-root]").filter(
                has_text=str(details.get("quantization_level", ""))
            )
            tip.first.wait_for(timeout=10000)
            tip_text = tip.first.inner_text()
            page.wait_for_timeout(600)  # let the tooltip finish fading in for the screenshot
            shot(page, "open-webui-model-details.png")
            # Open WebUI's UI shows nothing else from Ollama; its proxy of /api/show is what an
            # admin tool or a client of Open WebUI gets, so check memspec's answer survives it.
            r = ui_fetch(page, "/ollama/api/show", {"model": target["name"]})
            if r["status"] != 200 or not isinstance(r["json"], dict):
                raise StepFailed(
                    f"Open WebUI /ollama/api/show answered {r['status']}: {r['text'] or r['json']}"
                )
            show = r["json"]
            lacking = [
                k
                for k in ("details", "model_info", "capabilities", "template", "parameters")
                if k not in show
            ]
            if lacking:
                raise StepFailed(f"/api/show through Open WebUI lacks {lacking}")
            return {
                "selector_row": row_text,
                "tooltip": tip_text,
                "show": {
                    "details": show["details"],
                    "capabilities": show["capabilities"],
                    "architecture": show["model_info"].get("general.architecture"),
                    "model_info_keys": len(show["model_info"]),
                },
            }

        s.run("model_details", model_details)

        def model_selected() -> dict[str, Any]:
            open_selector(page)
            page.locator(f'button[role="option"][data-value="{target["name"]}"]').click()
            button = page.locator('button[id^="model-selector-"][id$="-button"]').first
            label = button.get_attribute("aria-label") or ""
            if target["name"] not in label and str(target.get("name")) not in button.inner_text():
                raise StepFailed(f"selector shows {label!r}, not {target['name']}")
            return {"selector_label": label}

        selected = s.run("model_selected", model_selected)

        def chat_streamed() -> dict[str, Any]:
            if not selected:
                raise StepFailed("no model selected")
            close_selector(page)
            before = page.locator(".chat-assistant").count()
            page.locator("#chat-input").click()
            page.keyboard.type(args.prompt)
            ws_start = len(ws_frames)
            t0 = time.monotonic()
            page.keyboard.press("Enter")
            lengths: list[tuple[float, int]] = []
            first_text_s: float | None = None
            deadline = t0 + args.answer_timeout
            done = False
            while time.monotonic() < deadline:
                n = page.locator(".chat-assistant").count()
                if n > before:
                    msg = page.locator(".chat-assistant").nth(n - 1)
                    text = msg.inner_text()
                    now = time.monotonic() - t0
                    if text.strip() and (not lengths or lengths[-1][1] != len(text)):
                        lengths.append((round(now, 2), len(text)))
                        first_text_s = first_text_s or now
                    if message_done(page, n - 1):
                        done = True
                        break
                page.wait_for_timeout(100)
            total_s = time.monotonic() - t0
            n = page.locator(".chat-assistant").count()
            answer = (
                page.locator(".chat-assistant").nth(n - 1).inner_text().strip()
                if n > before
                else ""
            )
            shot(page, "open-webui-chat.png")
            frames = [p for _, p in ws_frames[ws_start:] if "chat:completion" in p]
            result = {
                "answer": answer,
                "first_text_s": round(first_text_s or 0, 2),
                "total_s": round(total_s, 2),
                "observations": len(lengths),
                "length_series": lengths[:40],
                "socket_completion_frames": len(frames),
            }
            error_el = (
                page.locator(".chat-assistant")
                .nth(n - 1)
                .locator("[class*='error'], .text-red-500")
            )
            if n > before and error_el.count():
                result["ui_error"] = error_el.first.inner_text()[:500]
            s.data["chat"] = result
            if not done:
                raise StepFailed(
                    f"answer not finished after {args.answer_timeout:.0f} s"
                    f" (text so far: {answer[:200]!r})"
                )
            if not answer or "ui_error" in result:
                raise StepFailed(f"no answer text (UI shows {result.get('ui_error', answer)!r})")
            if len(lengths) < 2:
                raise StepFailed(
                    f"answer appeared at once ({len(lengths)} observation(s)):"
                    " not streamed to the page"
                )
            return result

        s.run("chat_streamed", chat_streamed)
        s.data["console_errors"] = console_errors[:20]
        browser.close()
    return finish(s, args.memspec_log, log_start, args.summary)


def message_done(page: Page, index: int) -> bool:
    """Open WebUI shows the copy button on an assistant message only once it is done."""
    return bool(
        page.locator(".chat-assistant")
        .nth(index)
        .evaluate(
            "el => el.closest('[id^=\"message-\"]').querySelector('.copy-response-button') !== null"
        )
    )


def finish(
    s: Summary, memspec_log: Path | None = None, log_start: int = 0, summary: Path | None = None
) -> int:
    def access_log() -> dict[str, Any]:
        if memspec_log is None:
            return {"skipped": "no --memspec-log (an external memspec)"}
        lines = access_lines(memspec_log, log_start)
        bad = [x for x in lines if x["status"] >= 400]
        counts: dict[str, int] = {}
        for x in lines:
            key = f"{x['method']} {x['path']} {x['status']}"
            counts[key] = counts.get(key, 0) + 1
        s.data["memspec_requests"] = counts
        if bad:
            errors = sorted({f"{b['method']} {b['path']} {b['status']}" for b in bad})
            raise StepFailed(f"memspec answered Open WebUI with errors: {errors}")
        if not any(x["path"].startswith("/api/chat") for x in lines):
            raise StepFailed("no /api/chat request reached memspec")
        return {"requests": counts}

    s.run("access_log", access_log)
    out = {"ok": s.first_failure() is None, "steps": s.steps, **s.data}
    text = json.dumps(out, indent=2, ensure_ascii=False)
    print(text)
    if summary is not None:
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(text + "\n")
    failed = s.first_failure()
    if failed:
        print(f"check_open_webui: FAILED at {failed['step']}: {failed['error']}", file=sys.stderr)
        return 1
    print("check_open_webui: all steps passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
