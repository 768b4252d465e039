"""`memspec bench structured`: greedy extraction under a strict JSON schema, plain decoding vs
memspec's speculation vs llama-server's configs, in one run.

The workload (bench/data/structured_extraction.jsonl) is held out: extraction prompts (an
invoice, an email, a log line, a bug report...; chats and raw completions), each with its own
strict `json_schema`. Nothing is tuned on it. memspec decodes each prompt under the grammar of
`response_format: {"type": "json_schema", ...}` (what the daemon builds for that field);
llama-server gets the same prompt tokens and the same schema in /completion's `json_schema`
field (its /v1/completions route ignores `response_format` and decodes unconstrained; only its
chat route reads it), and converts it with its own C++ converter, which allows more whitespace
than llama-cpp-python's (so its outputs may be other valid texts). With peer_constraint
"grammar" it gets memspec's GBNF instead, and its outputs must equal memspec's.

Configs and timing are `memspec bench engine`'s (memspec_lab/bench/engine.py): interleaved per
prompt, no KV reuse between configs, rate = tokens / (prompt processing + decoding). Every
memspec output must equal plain decoding's token for token (exit 1 otherwise); every output,
llama-server's too, is checked against its schema. Besides tokens/s, each config's time to
all the answers is reported against llama-server's fastest config: its outputs are other,
longer texts unless it decodes under memspec's GBNF.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memspec.config import Settings
from memspec.engine.grammar import Grammar
from memspec.engine.types import SamplingParams
from memspec.runtime import Runtime
from memspec.server.structured import response_format_grammar
from memspec_lab.bench.engine import (
    draft_file,
    generation_row,
    open_bench_runtime,
    speedup_summary,
    start_peer_servers,
)
from memspec_lab.bench.peer_server import PeerServer, generated_tokens, peer_configs

WORKLOAD = Path(__file__).resolve().parent / "data" / "structured_extraction.jsonl"
PLAIN = "none"
PEER_CONSTRAINTS = ("json_schema", "grammar")  # llama-server's /completion fields
# (name, draft, k, policy), as bench engine names its configs.
Config = tuple[str, str, int | None, str | None]
WARM_SCHEMA = {
    "type": "object",
    "properties": {"greeting": {"type": "string"}},
    "required": ["greeting"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ExtractionPrompt:
    id: str
    category: str
    text: str
    chat: bool  # render with the target's chat template; False: raw completion
    json_schema: dict[str, Any]  # OpenAI's {"name", "strict", "schema"}

    @property
    def schema(self) -> dict[str, Any]:
        return self.json_schema["schema"]


def load_extraction_prompts(
    path: Path = WORKLOAD, ids: list[str] | None = None, limit: int | None = None
) -> list[ExtractionPrompt]:
    """A workload file's prompts in file order: those of `ids` (all when None), the first
    `limit`. One JSON object a line: id, category, chat, prompt, json_schema."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [
        ExtractionPrompt(r["id"], r["category"], r["prompt"], r["chat"], r["json_schema"])
        for r in rows
    ]
    if ids is not None:
        unknown = sorted(set(ids) - {p.id for p in prompts})
        if unknown:
            known = ", ".join(p.id for p in prompts)
            raise ValueError(f"unknown structured prompts {unknown}; there are: {known}")
        prompts = [p for p in prompts if p.id in ids]
    return prompts[:limit] if limit is not None else prompts


# --- checking an output against its schema ---------------------------------------------------


def validator_name() -> str:
    try:
        import jsonschema
    except ImportError:
        return "json.loads + required keys, types, enums, no extra keys (jsonschema absent)"
    return f"jsonschema {getattr(jsonschema, '__version__', '')}".strip()


def schema_error(text: str, schema: dict[str, Any]) -> str | None:
    """Why `text` is not a JSON value `schema` accepts (None: it is)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        import jsonschema
    except ImportError:
        return _basic_schema_error(value, schema, "$")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return e.message
    return None


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):  # a bool is an int in Python
        return False
    return isinstance(value, _TYPES[kind])


def _basic_schema_error(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """The part of JSON Schema the workload's schemas use, for when jsonschema is absent."""
    kind = schema.get("type")
    if kind in _TYPES and not _is_type(value, kind):
        return f"{where}: not {kind}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{where}: missing {missing}"
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                return f"{where}: extra keys {extra}"
        for key, sub in props.items():
            if key in value and (err := _basic_schema_error(value[key], sub, f"{where}.{key}")):
                return err
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if err := _basic_schema_error(item, schema["items"], f"{where}[{i}]"):
                return err
    return None


# --- the run ---------------------------------------------------------------------------------


def run_structured_bench(
    settings: Settings,
    out: str,
    ids: list[str] | None = None,
    limit: int | None = None,
    max_tokens: int = 256,
    peer_server: bool = True,
    only: list[str] | None = None,
    workload: Path = WORKLOAD,
    peer_constraint: str = "json_schema",
) -> dict:
    """`only`: run just these configs (plain decoding always runs: it is the baseline).
    `peer_constraint`: what llama-server is sent, "json_schema" (the schema, which its own
    converter turns into a grammar: what its users send) or "grammar" (the GBNF memspec
    decodes under, so its outputs must equal memspec's token for token)."""
    if peer_constraint not in PEER_CONSTRAINTS:
        raise ValueError(f"peer_constraint is one of {', '.join(PEER_CONSTRAINTS)}")
    prompts = load_extraction_prompts(workload, ids, limit)
    rt, pool, model_draft = open_bench_runtime(settings)
    configs = memspec_configs(pool, model_draft)
    peer_draft = (model_draft, rt.draft_admin.manifest(model_draft)) if model_draft else None
    if only is not None:
        known = [n for n, *_ in configs] + list(peer_configs(draft_file(peer_draft)))
        unknown = [n for n in only if n not in known]
        if unknown:
            rt.close()
            raise ValueError(f"unknown bench configs {unknown}; there are: {', '.join(known)}")
        configs = [c for c in configs if c[0] == PLAIN or c[0] in only]
    servers, skipped = start_peer_servers(settings, peer_server, peer_draft, only)
    results: dict[str, list[dict]] = defaultdict(list)
    try:
        _warm_up(rt, configs, servers)
        # A fresh estimator per config: nothing learnt elsewhere steers its figures.
        estimators = {name: rt.new_estimator() for name, *_ in configs}
        for p in tqdm(prompts, desc="bench structured", unit="prompt"):
            _run_prompt(rt, p, max_tokens, configs, estimators, servers, peer_constraint, results)
    finally:
        for server in servers.values():
            server.close()
        rt.close()
    report = _report(settings, prompts, max_tokens, configs, results, skipped)
    report["workload"] = str(workload) if workload != WORKLOAD else WORKLOAD.name
    report["llama_server_constraint"] = peer_constraint
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print_structured_table(report)
    return report


def memspec_configs(pool: list[str], model_draft: str | None) -> list[Config]:
    """Plain decoding, the default policy, the bare decision rule, and prompt lookup and
    llama-server's -md draft alone (adaptive k) when the runtime has them."""
    configs: list[Config] = [
        (PLAIN, "none", None, None),
        ("memspec", "auto", None, "memspec"),
        ("auto", "auto", None, "auto"),
    ]
    for draft in ("prompt-lookup", model_draft):
        if draft in pool:
            configs.append((f"{draft} adaptive-k", draft, None, None))
    return configs


def _schema_grammar(rt: Runtime, json_schema: dict[str, Any]) -> Grammar:
    """The grammar memspec's daemon builds for response_format json_schema."""
    gbnf = response_format_grammar({"type": "json_schema", "json_schema": json_schema})
    assert gbnf is not None
    return Grammar(gbnf, rt.target.path, param="response_format")


def _warm_up(
    rt: Runtime,
    configs: list[Config],
    servers: dict[str, PeerServer],
) -> None:
    """Every config once on a prompt and schema outside the workload, so draft loads, first
    cost corrections and llama-server's first request are not charged to one prompt."""
    prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": "Greet me, as JSON."}])
    grammar = _schema_grammar(rt, {"name": "greeting", "strict": True, "schema": WARM_SCHEMA})
    params = SamplingParams(max_tokens=16, grammar=grammar)
    for _name, draft, k, policy in configs:
        rt.generate(prompt, params, draft=draft, k=k, policy=policy)
    for server in servers.values():
        server.complete_json(prompt, 16, json_schema=WARM_SCHEMA)


def _run_prompt(
    rt: Runtime,
    p: ExtractionPrompt,
    max_tokens: int,
    configs: list[Config],
    estimators: dict,
    servers: dict[str, PeerServer],
    peer_constraint: str,
    results: dict[str, list[dict]],
) -> None:
    if p.chat:
        prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": p.text}])
    else:
        prompt = rt.requests.prompt_tokens(prompt=p.text)
    grammar = _schema_grammar(rt, p.json_schema)
    params = SamplingParams(max_tokens=max_tokens, grammar=grammar)
    base = {"id": p.id, "category": p.category}
    plain_ids: list[int] = []
    for name, draft, k, policy in configs:
        rt.target.reset()  # no KV reuse across configs: each pays its prefill
        # A named policy keeps its own statistics across prompts; the rule gets the config's.
        est = None if policy == "memspec" else estimators[name]
        gen = rt.generate(prompt, params, draft=draft, k=k, estimator=est, policy=policy)
        if name == PLAIN:
            plain_ids = gen.token_ids
        results[name].append(
            {
                **base,
                **generation_row(gen),
                "finish_reason": gen.finish_reason,
                "identical": gen.token_ids == plain_ids,
                "schema_error": schema_error(gen.text, p.schema),
                "text": gen.text,
            }
        )
    for name, server in servers.items():
        constraint = p.schema if peer_constraint == "json_schema" else grammar.gbnf
        out = server.complete_json(prompt, max_tokens, **{peer_constraint: constraint})
        t = out.get("timings", {})
        ids = generated_tokens(out, rt.target.eos_token_ids)
        text = rt.target.detokenize(ids).decode(errors="replace")
        results[name].append(
            {
                **base,
                "tokens": len(ids),
                "seconds": (t.get("prompt_ms", 0.0) + t.get("predicted_ms", 0.0)) / 1e3,
                "proposed": t.get("draft_n", 0),
                "accepted": t.get("draft_n_accepted", 0),
                "finish_reason": "stop" if out.get("stop_type") in ("eos", "word") else "length",
                "identical": ids == plain_ids,
                "schema_error": schema_error(text, p.schema),
                "text": text,
            }
        )


def _report(
    settings: Settings,
    prompts: list[ExtractionPrompt],
    max_tokens: int,
    configs: list[Config],
    results: dict[str, list[dict]],
    skipped: str,
) -> dict:
    ours = [name for name, *_ in configs]
    plain = results[PLAIN]
    summaries = {name: speedup_summary(rows, plain) for name, rows in results.items()}
    peers = {n: s["tokens_per_s"] for n, s in summaries.items() if n not in ours}
    best_peer = max(peers, key=peers.__getitem__) if peers else None
    # llama-server's converter allows whitespace ours does not: its outputs are other texts,
    # often longer, whose extra tokens raise its tok/s. The time to all the answers compares
    # the systems whatever the texts.
    seconds = {n: round(sum(r["seconds"] for r in rows), 2) for n, rows in results.items()}
    fastest_peer = min((n for n in seconds if n not in ours), key=seconds.__getitem__, default=None)
    entries: dict[str, dict] = {}
    for name, rows in results.items():
        overall = summaries[name]
        overall["valid"] = sum(r["schema_error"] is None for r in rows)
        overall["all_valid"] = overall["valid"] == len(rows)
        overall["vs_llama_server_best"] = (
            round(overall["tokens_per_s"] / max(peers[best_peer], 1e-9), 3) if best_peer else None
        )
        overall["seconds"] = seconds[name]
        overall["time_vs_llama_server_fastest"] = (
            round(seconds[fastest_peer] / max(seconds[name], 1e-9), 3) if fastest_peer else None
        )
        plain_rate = {r["id"]: r["tokens"] / max(r["seconds"], 1e-9) for r in plain}
        per_prompt = {
            r["id"]: {
                "tokens_per_s": round(r["tokens"] / max(r["seconds"], 1e-9), 2),
                "speedup": round(r["tokens"] / max(r["seconds"], 1e-9) / plain_rate[r["id"]], 3),
            }
            for r in rows
        }
        entries[name] = {
            "system": "memspec" if name in ours else "llama-server",
            "overall": overall,
            "per_prompt": per_prompt,
            "runs": rows,
        }
    return {
        "benchmark": "structured",
        "target": settings.target,
        "max_tokens": max_tokens,
        "prompts": [p.id for p in prompts],
        "validator": validator_name(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "n_threads": settings.n_threads,
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "peer_server_skipped": skipped,
        "llama_server_best": (
            {"config": best_peer, "tokens_per_s": peers[best_peer]} if best_peer else None
        ),
        "llama_server_fastest": (
            {"config": fastest_peer, "seconds": seconds[fastest_peer]} if fastest_peer else None
        ),
        "configs": entries,
        # memspec's outputs against plain decoding's: the lossless promise, exit 1 if broken.
        "all_identical": all(entries[n]["overall"]["identical_to_plain"] for n in ours),
        "all_valid": all(e["overall"]["all_valid"] for e in entries.values()),
    }


def print_structured_table(report: dict) -> None:
    best = report["llama_server_best"]
    print(
        f"\nstructured: {len(report['prompts'])} prompts under their JSON schema, greedy, "
        f"{report['max_tokens']} tokens max; llama-server's best: "
        + (f"{best['config']} ({best['tokens_per_s']:.1f} tok/s)" if best else "none")
    )
    fastest = report.get("llama_server_fastest")
    if fastest:
        print(
            f"x llama: tok/s over its best's; x time: its fastest config's time to all the "
            f"answers ({fastest['config']}, {fastest['seconds']:.1f} s) over this one's"
        )
    print(
        f"{'config':38s} {'tok/s':>8s} {'x plain':>8s} {'(worst)':>8s} {'x llama':>8s} "
        f"{'seconds':>8s} {'x time':>7s} valid"
    )
    for name, e in report["configs"].items():
        o = e["overall"]
        vs, vs_time = o["vs_llama_server_best"], o.get("time_vs_llama_server_fastest")
        same = ""
        if not o["identical_to_plain"]:
            same = "  (outputs differ!)" if e["system"] == "memspec" else "  (other output)"
        print(
            f"{name:38s} {o['tokens_per_s']:8.2f} {o['speedup']:8.2f} "
            f"{o['worst_prompt_speedup'] or 0:8.2f} {'-' if vs is None else f'{vs:.2f}':>8s} "
            f"{o.get('seconds', 0):8.1f} {'-' if vs_time is None else f'{vs_time:.2f}':>7s} "
            f"{o['valid']}/{o['prompts']}{same}"
        )
