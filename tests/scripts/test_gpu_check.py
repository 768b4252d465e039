"""scripts/gpu_check.sh (issue 40): without a GPU or a CUDA toolkit it fails at once, in one
line; its random GGUFs have the real architectures' tensors and load in llama.cpp."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from memspec.paths import models_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)


def run_script(tmp_path: Path, tools: dict[str, str], **env: str) -> subprocess.CompletedProcess:
    """The script with PATH holding only the system's bin folders and the fake `tools`."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for name, body in tools.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    full = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path), **env}
    return subprocess.run(
        ["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=30
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: ")
    return lines[0]


def test_no_gpu_fails_in_one_line(tmp_path):
    line = one_line(run_script(tmp_path, {}))
    assert "no GPU found" in line and "--cpu" in line


def test_a_gpu_less_nvidia_smi_fails_in_one_line(tmp_path):
    line = one_line(run_script(tmp_path, {"nvidia-smi": "exit 9"}))
    assert "no GPU found" in line


def test_no_cuda_toolkit_fails_in_one_line(tmp_path):
    smi = 'echo "NVIDIA H100 80GB HBM3, 9.0"'
    line = one_line(run_script(tmp_path, {"nvidia-smi": smi}, CUDA_HOME=str(tmp_path / "none")))
    assert "no CUDA toolkit" in line


def test_nothing_carried_fails_in_one_line(tmp_path):
    tools = {"nvidia-smi": 'echo "NVIDIA H100 80GB HBM3, 9.0"', "nvcc": "exit 0"}
    line = one_line(run_script(tmp_path, tools, GPU_CHECK_CARRY=str(tmp_path / "none")))
    assert "--prepare" in line


def real_model(name: str) -> Path:
    path = models_dir() / name
    if not path.is_file():
        pytest.skip(f"{name} not in {models_dir()} (scripts/setup.sh fetches it)")
    return path


@pytest.mark.parametrize("shape", sorted(gpu_check.SHAPES))
def test_the_shapes_are_the_real_models(shape):
    s = gpu_check.SHAPES[shape]
    assert gpu_check.check_shape(s, real_model(s.real_file)) == []


def test_a_random_gguf_of_a_tiny_shape_loads_and_quantizes(tmp_path):
    """The writer at a tiny llama shape with SmolLM2's real tokenizer: llama.cpp loads it,
    decodes, and its quantizer makes a K-quant of it."""
    import llama_cpp
    import numpy as np

    tok = tmp_path / "tok.gguf"
    gpu_check.write_tokenizer_gguf(real_model("SmolLM2-135M-Instruct.Q4_1.gguf"), tok, "llama")
    tiny = gpu_check.Shape(
        "tiny", "llama", 256, 512, 2, 4, 2, 2048, 1e4, 1e-5, False, True, "smollm2", "none"
    )
    f32 = tmp_path / "tiny-f32.gguf"
    info = gpu_check.write_random_gguf(f32, tiny, tok, "F32")
    assert info["layers"] == 2 and info["params"] == 49152 * 256 + 256 + 2 * (
        2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256
    )
    real = llama_cpp.Llama(
        model_path=str(real_model("SmolLM2-135M-Instruct.Q4_1.gguf")),
        vocab_only=True,
        verbose=False,
    )
    text = "Hello, world! <|im_start|>user\nÜnïcödé 123"
    q = tmp_path / "tiny-q4_k_m.gguf"
    gpu_check.quantize(f32, q, "Q4_K_M")
    for path in (f32, q):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
        assert llm.tokenize(text.encode(), special=True) == real.tokenize(
            text.encode(), special=True
        )
        tokens = llm.tokenize(b"The quick brown fox")
        llm.eval(tokens)
        assert llm.n_vocab() == 49152 and np.isfinite(llm.scores[len(tokens) - 1]).all()
        del llm
