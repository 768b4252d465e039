"""llama.cpp's own `llama-server` as a benchmark peer, driven over HTTP on the same prompts.

Built by `scripts/setup.sh --peer` (scripts/build_peer.sh) from the llama.cpp that the pinned
llama-cpp-python vendors, with the same CMake flags as the installed library, and linked as
`data/bin/llama-server` (or named by $MEMSPEC_LLAMA_SERVER). Its rate is llama-server's own
timing of prompt processing plus decoding (`timings.prompt_ms + predicted_ms`), the same span
as memspec's `elapsed_s`: no process start, no model load, no HTTP. The prompt's share is kept
apart (`prefill_s`), as memspec's is, so a gap can be placed in prefill or in decoding. It
runs llama.cpp's own kernels on every pass (a verification's rows through gemm and the tiled
matmul too), where memspec keeps the row rule (backends/llama_cpp.py) for bit-exact
verification.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from memspec.config import Settings, env_llama_server
from memspec.paths import data_dir, resolve_model_path

# llama-server's n-gram speculation as DESIGN.md measured it best on this CPU.
NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
         "--spec-ngram-simple-size-m", "8"]  # fmt: skip


def peer_configs(draft: tuple[str, Path] | None) -> dict[str, list[str]]:
    """llama-server's configs: plain, n-gram, and with `draft` (id, GGUF) as its -md."""
    configs = {"llama-server plain": [], "llama-server ngram-simple": NGRAM}
    if draft is not None and draft[1].is_file():
        draft_id, path = draft
        configs[f"llama-server -md {draft_id}"] = ["-md", str(path)]
        configs[f"llama-server ngram-simple + -md {draft_id}"] = NGRAM + ["-md", str(path)]
    return configs


def kv_flags(settings: Settings) -> list[str]:
    """The KV cache memspec's contexts use, for the target and its -md: the same types, the
    same sliding-window cache size, and the same attention kernels (the server's default
    `-fa auto` would turn flash attention on where memspec's f16 path runs without it, and
    its sums round differently)."""
    kv, draft = settings.kv_cache, settings.draft_kv_cache
    return [
        "-fa", "on" if kv.flash_attn else "off",
        "-ctk", kv.type_k, "-ctv", kv.type_v, "-ctkd", draft.type_k, "-ctvd", draft.type_v,
        *(["--swa-full"] if kv.swa_full else []),
    ]  # fmt: skip


class PeerCompletion(NamedTuple):
    """One greedy /completion answer, as the bench records it."""

    tokens: list[int]  # as memspec counts them (generated_tokens)
    seconds: float  # prompt processing and decoding, llama-server's own timing
    prefill_s: float  # its prompt processing alone
    drafted: int
    accepted: int


def completion(out: dict, eos: frozenset[int]) -> PeerCompletion:
    """What the bench reads of llama-server's /completion answer."""
    t = out.get("timings", {})
    prefill_s = t.get("prompt_ms", 0.0) / 1e3
    return PeerCompletion(
        tokens=generated_tokens(out, eos),
        seconds=prefill_s + t.get("predicted_ms", 0.0) / 1e3,
        prefill_s=prefill_s,
        drafted=t.get("draft_n", 0),
        accepted=t.get("draft_n_accepted", 0),
    )


def generated_tokens(out: dict, eos: frozenset[int]) -> list[int]:
    """The tokens of llama-server's /completion answer without the end-of-generation token it
    stopped on, which it returns (and counts) and memspec's generations do not."""
    tokens = list(out.get("tokens", []))
    if tokens and tokens[-1] in eos:
        tokens.pop()
    return tokens


class PeerServer:
    def __init__(
        self,
        binary: Path,
        settings: Settings,
        flags: list[str],
        timeout_s: float = 120,
        models: list[str] | None = None,
    ):
        """`models`: what it serves, as llama-server's arguments (default: `-m` the settings'
        target; router mode: `--models-dir DIR`, with `--models-max N` among `flags`)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        threads = str(settings.n_threads or os.cpu_count() or 1)
        if models is None:
            models = ["-m", str(resolve_model_path(settings.target))]
        cmd = [
            str(binary), *models, "--host", "127.0.0.1",
            "--port", str(self.port), "-t", threads, "-tb", threads, "-np", "1",
            "-c", str(settings.n_ctx), *kv_flags(settings), *flags,
        ]  # fmt: skip
        # Its log goes to a file, not a pipe: nobody reads a pipe while it serves, and once
        # 64 KiB of per-request log filled it, llama-server blocked in write() mid-benchmark.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")
                self.log.close()
                raise RuntimeError(f"exit {self.proc.returncode}: {err.strip()[-300:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"no /health within {timeout_s:.0f} s")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def find() -> Path | None:
        path = env_llama_server() or data_dir() / "bin" / "llama-server"
        return path if path.is_file() and os.access(path, os.X_OK) else None

    def complete(
        self, prompt: list[int], max_tokens: int, eos: frozenset[int], **fields: Any
    ) -> PeerCompletion:
        """Greedy completion of token ids, timed by llama-server itself."""
        return completion(self.complete_json(prompt, max_tokens, **fields), eos)

    def complete_json(self, prompt: list[int], max_tokens: int, **fields: Any) -> dict:
        """Greedy completion of token ids: llama-server's whole answer (`tokens`, `timings`).
        `fields`: more of /completion's request fields (e.g. `json_schema`)."""
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,  # each prompt pays its prefill, as memspec's configs do
            "return_tokens": True,
            **fields,
        }
        req = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
