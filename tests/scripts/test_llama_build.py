"""scripts/llama_build.py: a build that crashes on a model kind is replaced, never installed."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memspec.paths import models_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llama_build", ROOT / "scripts" / "llama_build.py")
llama_build = importlib.util.module_from_spec(_spec)
sys.modules["llama_build"] = llama_build  # dataclasses look their module up there
_spec.loader.exec_module(llama_build)

AMX_CPU = "flags : fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512_vnni amx_tile amx_int8"


def test_fallback_build_names_the_isa_and_turns_native_and_amx_off():
    args = llama_build.fallback_cmake_args("-DGGML_LLAMAFILE=OFF ", AMX_CPU, "x86_64").split()
    assert args[:2] == ["-DGGML_LLAMAFILE=OFF", "-DGGML_NATIVE=OFF"]
    for on in ("AVX2", "FMA", "AVX512", "AVX512_VNNI"):
        assert f"-DGGML_{on}=ON" in args
    for off in ("AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX512_BF16"):
        assert f"-DGGML_{off}=OFF" in args


class FakeToolchain:
    """Builds and installs nothing real; the probe 'crashes' on any build still GGML_NATIVE."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.installed: list[Path] = []
        self.probed: list[str] = []
        self.current = ""

    def build(self, version: str, args: str, dest: Path) -> None:
        self.built.append(args)
        dest.mkdir(parents=True)
        (dest / "llama_cpp_python-0-cp311-linux_x86_64.whl").write_text(args)

    def install(self, wheels: Path) -> None:
        self.installed.append(wheels)
        self.current = next(wheels.glob("*.whl")).read_text()

    def probe(self, model: Path):
        self.probed.append(self.current)
        if "GGML_NATIVE=OFF" in self.current:
            return llama_build.ProbeResult(True, {"source": "ok", "Q4_0": "ok"})
        return llama_build.ProbeResult(False, {"source": "ok", "Q4_0": "crashed with SIGILL"})


def run_ensure(tmp_path: Path, tools: FakeToolchain):
    return llama_build.ensure(
        tmp_path / "model.gguf",
        cpu_line=AMX_CPU,
        cache=tmp_path / "wheels",
        build=tools.build,
        install=tools.install,
        probe=tools.probe,
        is_ok=lambda version, batch_invariant: True,
        stamp=tmp_path / "stamp.json",
    )


def test_a_crashing_build_is_rebuilt_without_native_and_remembered(tmp_path):
    tools = FakeToolchain()
    outcome = run_ensure(tmp_path, tools)
    assert len(tools.built) == 2 and "GGML_NATIVE=OFF" not in tools.built[0]
    assert "GGML_NATIVE=OFF" in outcome.cmake_args and "GGML_AMX_INT8=OFF" in outcome.cmake_args
    assert "SIGILL" in outcome.fallback_reason and outcome.probe["Q4_0"] == "ok"
    assert list((tmp_path / "wheels").glob("*.crashed"))
    assert json.loads((tmp_path / "stamp.json").read_text())["cmake_args"] == outcome.cmake_args

    # Setup again: the crashing build is not rebuilt or reinstalled, nor the good one re-probed.
    again = FakeToolchain()
    again.current = outcome.cmake_args
    second = run_ensure(tmp_path, again)
    assert (again.built, again.installed, again.probed) == ([], [], [])
    assert second.cmake_args == outcome.cmake_args and "SIGILL" in second.fallback_reason


def test_setup_fails_loudly_when_no_build_runs(tmp_path):
    tools = FakeToolchain()
    tools.probe = lambda model: llama_build.ProbeResult(False, {"F32": "crashed with SIGSEGV"})
    with pytest.raises(SystemExit, match="no llama-cpp-python build runs"):
        run_ensure(tmp_path, tools)
    assert not (tmp_path / "stamp.json").exists()


def test_a_killed_subprocess_is_reported_by_signal_name():
    proc = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    )
    assert proc.returncode == -signal.SIGILL
    assert llama_build.describe_exit(proc.returncode, "") == "crashed with SIGILL"
    assert llama_build.describe_exit(1, "boom\nValueError: bad\n") == "exit 1: ValueError: bad"


@pytest.mark.models
def test_the_installed_library_runs_a_quantized_model():
    source = models_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = llama_build.probe_library(source, ftypes=("Q4_0",))
    assert result.ok, result.failure
    assert set(result.runs) == {"source", "Q4_0"}
