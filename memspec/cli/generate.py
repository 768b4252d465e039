"""`memspec generate`: one generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from memspec.cli.flags import load_settings, model_flags
from memspec.config import Settings

JSON_FIELDS = (
    "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "drafts_used",
    "proposed", "accepted", "acceptance", "rounds", "k_per_round", "tokens_per_s", "elapsed_s",
)  # fmt: skip
ROUND_DIGITS = {"acceptance": 4, "tokens_per_s": 2, "elapsed_s": 4}


def check_named_draft(settings: Settings, draft_id: str) -> None:
    """DraftIncompatible (one line, exit 2) for a draft that speaks another tokenizer than
    the target, UnknownDraft for one its family skipped, before any model loads; any other
    unknown id is left to the runtime to name."""
    from memspec.drafts.compat import fingerprint_of, require_compatible
    from memspec.drafts.family import settings_pool_dir, skipped_error, skipped_recipes
    from memspec.drafts.manifest import load_manifests
    from memspec.paths import models_dir, resolve_model_path

    pool = settings_pool_dir(settings)
    m = load_manifests(pool).get(draft_id)
    skipped = skipped_recipes(pool)
    if m is None and draft_id in skipped:
        raise skipped_error(draft_id, skipped[draft_id])
    if m is not None:
        target = fingerprint_of(resolve_model_path(settings.target))
        require_compatible(target, m, models_dir())


def cmd_generate(args: argparse.Namespace) -> int:
    from memspec.engine.sampling import SamplingParams
    from memspec.runtime import Runtime
    from memspec.scheduler.draft_choice import DraftAsk

    settings = load_settings(args)
    if DraftAsk.parse(args.draft).named is not None:
        check_named_draft(settings, args.draft)
        if args.drafts is None:
            settings = settings.model_copy(update={"drafts": [args.draft]})
    rt = Runtime(settings)
    try:
        if args.chat:
            prompt = rt.requests.prompt_tokens(messages=[{"role": "user", "content": args.prompt}])
        else:
            prompt = rt.requests.prompt_tokens(args.prompt)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or [],
        )

        def stream(delta: str, _tok: int | None) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        gen = rt.generate(
            prompt, params, draft=args.draft, k=args.k, on_token=None if args.json else stream
        )
    finally:
        rt.close()
    if args.json:  # the contract: one JSON object on the last line
        stats = {k: getattr(gen, k) for k in JSON_FIELDS}
        stats.update({k: round(stats[k], digits) for k, digits in ROUND_DIGITS.items()})
        print(json.dumps(stats))
    else:
        print()
        print(
            f"[{gen.completion_tokens} tokens, {gen.tokens_per_s:.1f} tok/s, "
            f"accepted {gen.accepted}/{gen.proposed}, drafts {gen.drafts_used}]",
            file=sys.stderr,
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="one generation from the command line")
    model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--draft", default="auto", help="draft id, 'none' or 'auto' (default)")
    p.add_argument("--k", type=int, help="fixed draft length (default: chosen per round)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the stats")
    p.set_defaults(func=cmd_generate)
