"""The benchmark peer's process handling, with a stand-in binary (llama-server is built only
on demand): its log must never block it."""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap

from memspec_lab.bench.peer_server import (
    PeerServer,
    completion,
    generated_tokens,
    kv_flags,
)

# Logs 256 KiB (llama-server logs every request) before it answers /health: a pipe nobody
# reads holds 64 KiB, so the server blocked in write() and never answered.
FAKE_SERVER = textwrap.dedent(
    f"""\
    #!{sys.executable}
    import http.server, os, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    sys.stderr.write("GGML_CPU_TILED_MM=%s\\n" % os.environ.get("GGML_CPU_TILED_MM", "unset"))
    sys.stderr.write("request log line\\n" * 16384)
    sys.stderr.flush()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{{}}")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def test_a_chatty_peer_is_not_blocked_by_its_log(tmp_path, settings):
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    server = PeerServer(binary, settings, [], timeout_s=20)
    try:
        assert server.proc.poll() is None
    finally:
        server.close()
    assert server.proc.returncode is not None


def test_the_stop_token_llama_server_returns_is_not_a_generated_token():
    """llama-server returns (and counts) the end-of-generation token it stopped on; memspec's
    generations do not hold it, so a comparison with it left in said "outputs differ"."""
    eos = frozenset({2})
    assert generated_tokens({"tokens": [5, 6, 2]}, eos) == [5, 6]
    assert generated_tokens({"tokens": [5, 6, 7]}, eos) == [5, 6, 7]  # cut at max_tokens
    assert generated_tokens({"tokens": [2, 5]}, eos) == [2, 5]  # only a last token stops
    assert generated_tokens({}, eos) == []


def test_the_peer_runs_memspecs_kv_cache(settings):
    """Same types for the target and its -md, and the same attention kernels: flash attention
    only where memspec's contexts use it (llama-server's own default is auto)."""
    flags = kv_flags(settings)
    assert flags[:2] == ["-fa", "off"] and flags.count("f16") == 4
    quant = settings.model_copy(update={"kv_type_k": "q8_0", "kv_type_v": "q8_0"})
    flags = dict(zip(kv_flags(quant)[::2], kv_flags(quant)[1::2], strict=True))
    assert flags == {"-fa": "on", "-ctk": "q8_0", "-ctv": "q8_0", "-ctkd": "q8_0", "-ctvd": "q8_0"}
    draft = quant.model_copy(update={"draft_kv_type_k": "q4_0", "draft_kv_type_v": "q4_0"})
    assert kv_flags(draft)[-4:] == ["-ctkd", "q4_0", "-ctvd", "q4_0"]


def test_the_prompts_share_of_llama_servers_time_is_kept_apart():
    """The bench compares decoding apart from prompt processing: llama-server's own timings
    give both, and its seconds are their sum (the span memspec's elapsed_s covers)."""
    out = {
        "tokens": [5, 6, 2],
        "timings": {
            "prompt_ms": 1500.0,
            "predicted_ms": 250.0,
            "draft_n": 4,
            "draft_n_accepted": 3,
        },
    }
    done = completion(out, frozenset({2}))
    assert done.tokens == [5, 6]
    assert done.prefill_s == 1.5 and done.seconds == 1.75
    assert (done.drafted, done.accepted) == (4, 3)
    assert completion({}, frozenset()).seconds == 0.0  # an answer without timings


def test_the_peer_runs_llama_cpps_own_kernels(tmp_path, settings, monkeypatch):
    """memspec leaves ggml's tiled K-quant matmul on (the row rule keeps verification exact
    beside it), so llama-server, started from memspec's process, runs it as its users do:
    importing memspec sets no GGML_CPU_TILED_MM, and the peer inherits none."""
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    probe = "import os, memspec.cli; print(os.environ.get('GGML_CPU_TILED_MM', 'unset'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "unset", done.stderr
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    server = PeerServer(binary, settings, [], timeout_s=20)
    try:  # it answered /health: its first line is written
        server.log.seek(0)
        assert server.log.readline() == b"GGML_CPU_TILED_MM=unset\n"
    finally:
        server.close()
