"""Fuzz every operation of the daemon's own OpenAPI schema with schemathesis, against the real
running daemon over loopback: positive and negative examples, a bounded number per operation.
Zero 5xx, and every error is OpenAI-shaped ({"error": {message, type, param, code}}).

Kept fast and side-effect bounded on purpose: generation lengths are clamped to a few tokens
(an out-of-range value is left as generated, so the 400 path is still fuzzed), and /admin/tune
is not allowed to reload the models with a new n_ctx (tests/server covers that path).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from launcher import MODEL
from reliability_harness import HARDENED_N_CTX
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
from schemathesis.generation.modes import GenerationMode

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

EXAMPLES = 30  # per operation and generation mode (positive, negative)
TRIED: Counter[str] = Counter()
STATUSES: Counter[int] = Counter()


def openai_shaped_errors(ctx, response, case) -> None:
    """Every 4xx/5xx body is exactly an OpenAI error object with a message; on Ollama's
    routes (/api/*), exactly Ollama's {"error": "message"}."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} body is not JSON: {response.content[:200]!r}"
        ) from None
    if case.path.startswith("/api/"):
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert isinstance(body["error"], str) and body["error"].strip(), body
        assert "Traceback" not in body["error"], body
        return
    if case.path == "/health" and response.status_code == 503:
        body = {"error": body.get("error")}  # /health adds its state beside the error
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert "Traceback" not in err["message"], err


DRAFT_IDS = ["auto", "none", "prompt-lookup", "q4_0", "q2_k"]
# Operations not fuzzed: they reach out to registries and write, send or remove model files
# (a fuzzed name could be a real model's); tests/test_ollama_registry.py drives them for real.
NOT_FUZZED = {"POST /api/pull", "POST /api/push", "DELETE /api/delete"}


def _pick(value: object, choices: list[str]) -> str:
    return choices[zlib.crc32(repr(value).encode()) % len(choices)]


def steer(case, mode: GenerationMode) -> None:
    """Positive cases name the served model and, half the time, a real draft, so they reach
    the engine and the working set instead of stopping at a 404."""
    if mode is not GenerationMode.POSITIVE:
        return
    params = case.path_parameters
    if isinstance(params, dict) and "draft_id" in params and zlib.crc32(b"%r" % params) % 2:
        params["draft_id"] = _pick(params["draft_id"], DRAFT_IDS[2:])
    body = case.body
    if isinstance(body, dict) and case.path.startswith(("/v1/", "/api/")):
        body["model"] = MODEL
        if "draft" in body and zlib.crc32(repr(body).encode()) % 2:
            body["draft"] = _pick(body["draft"], DRAFT_IDS)


def keep_it_short(case) -> None:
    """Clamp valid generation lengths to 4 tokens; keep n_ctx where it is (no reloads)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 4 < v <= HARDENED_N_CTX:
            body[key] = 4
    if case.path == "/admin/tune":
        v = body.get("n_ctx")
        if isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 1 << 20:
            body["n_ctx"] = HARDENED_N_CTX


def fuzz_operation(operation, mode: GenerationMode, hardened, failures: list[str]) -> None:
    """EXAMPLES cases of one operation in one mode; failures are collected, not raised, so
    every operation is tried and nothing is shrunk (the run stays bounded in time)."""
    headers = hardened.admin if operation.path.startswith("/admin") else hardened.api

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        steer(case, mode)
        keep_it_short(case)
        response = case.call(headers=headers, timeout=120)
        TRIED[f"{case.method.upper()} {case.path}"] += 1
        STATUSES[response.status_code] += 1
        try:
            case.validate_response(response, checks=[not_a_server_error, openai_shaped_errors])
        except Exception as e:  # noqa: BLE001 - a failed check, reported with its request
            body = case.body if case.body is not NOT_SET else None
            failures.append(
                f"{mode.value} {case.method.upper()} {case.formatted_path} body={body!r:.300} "
                f"-> {response.status_code} {response.content[:300]!r}: {str(e)[:300]}"
            )

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
        assert mode is GenerationMode.NEGATIVE, operation.label


def test_fuzz_from_openapi_schema(hardened):
    schema = schemathesis.openapi.from_url(hardened.url + "/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if f"{operation.method.upper()} {operation.path}" in NOT_FUZZED:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode, hardened, failures)
    print(f"\nfuzz: {sum(TRIED.values())} examples; per operation {dict(TRIED)}")
    print(f"fuzz: statuses {dict(sorted(STATUSES.items()))}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_fuzz_covered_every_operation_and_the_daemon_still_serves(hardened):
    """After the fuzz: every operation was tried, the daemon is healthy, settings the
    fuzz tuned are put back, and a request is answered."""
    print(f"\nfuzz examples per operation: {dict(TRIED)}; statuses: {dict(STATUSES)}")
    spec = httpx.get(hardened.url + "/openapi.json").json()
    operations = {f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops}
    operations -= NOT_FUZZED
    assert operations <= set(TRIED), f"not fuzzed: {operations - set(TRIED)}"
    assert sum(TRIED.values()) >= 10 * len(operations)
    assert not [s for s in STATUSES if s >= 500]
    r = httpx.post(
        hardened.url + "/admin/tune",
        json={"budget": "2GiB", "policy": "auto", "k_max": 8},
        headers=hardened.admin,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert httpx.get(hardened.url + "/health").status_code == 200
    ok = httpx.post(
        hardened.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        headers=hardened.api,
        timeout=120,
    )
    assert ok.status_code == 200, ok.text
