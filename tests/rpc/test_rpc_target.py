"""The target split over two ggml RPC workers (and this device), on the real model: outputs
identical to the local target; a worker unreachable, killed or stalled is a clean
DeviceUnavailable, never a dead process, and the target comes back with its workers."""

from __future__ import annotations

import time

import pytest
from launcher import free_port
from rpc_workers import workers

from memspec.config import Settings
from memspec.engine.types import SamplingParams
from memspec.errors import DeviceUnavailable
from memspec.runtime import Runtime

GREEDY = SamplingParams(max_tokens=24)


def _split_runtime(endpoints: list[str], **kw) -> Runtime:
    """The target's layers in equal shares over the workers and this device."""
    settings = Settings.load(
        drafts=["prompt-lookup", "q4_0"], n_ctx=1024, n_threads=1, rpc=endpoints,
        tensor_split=[1.0] * (len(endpoints) + 1), **kw,
    )  # fmt: skip
    return Runtime(settings, calibrate_costs=False)


@pytest.fixture(scope="module")
def reference(runtime, chat_prompts) -> list[list[int]]:
    """The local target's own greedy output for each prompt."""
    return [runtime.generate(p, GREEDY, draft="none").token_ids for p in chat_prompts]


def test_split_target_decodes_exactly_what_the_local_target_does(tmp_path, chat_prompts, reference):
    with workers(tmp_path, 2, delay_s=0.001) as ws:
        rt = _split_runtime([w.endpoint for w in ws])
        try:
            devices = rt.devices()
            assert [d["device"] for d in devices] == ["local"] + [w.endpoint for w in ws]
            assert sum(d["layers"] for d in devices) == rt.target.n_layers + 1
            assert all(d["layers"] > 0 and d["bytes"] > 0 for d in devices)
            assert rt.target.describe()["isolated"] is True
            for prompt, ref in zip(chat_prompts, reference, strict=True):
                for draft, k in (("none", None), ("q4_0", 4), ("prompt-lookup", 4), ("auto", None)):
                    out = rt.generate(prompt, GREEDY, draft=draft, k=k).token_ids
                    assert out == ref, (draft, k)
            # Seeded sampling draws the same tokens as on the local target: same logits.
            seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
            local = Runtime(Settings.load(drafts=["prompt-lookup"], n_ctx=1024, n_threads=1),
                            calibrate_costs=False)  # fmt: skip
            try:
                want = local.generate(chat_prompts[0], seeded, draft="none").token_ids
            finally:
                local.close()
            assert rt.generate(chat_prompts[0], seeded, draft="none").token_ids == want
        finally:
            rt.close()


@pytest.mark.models
def test_a_worker_unreachable_at_start_is_a_clear_error():
    dead = f"127.0.0.1:{free_port()}"
    t = time.monotonic()
    with pytest.raises(DeviceUnavailable, match=f"rpc worker {dead} unreachable"):
        _split_runtime([dead])
    assert time.monotonic() - t < 30


def test_a_worker_killed_mid_generation_fails_the_request_and_comes_back(
    tmp_path, chat_prompts, reference
):
    with workers(tmp_path, 2) as ws:
        rt = _split_runtime([w.endpoint for w in ws])
        try:
            seen: list[str] = []

            def kill_after_some(delta: str, _tok: int | None) -> None:
                seen.append(delta)
                if len(seen) == 4:
                    ws[1].kill()

            with pytest.raises(DeviceUnavailable, match="rpc worker"):
                rt.generate(chat_prompts[0], GREEDY, draft="none", on_token=kill_after_some)
            assert rt.target.lost
            with pytest.raises(DeviceUnavailable):  # every call, until it is back
                rt.generate(chat_prompts[0], GREEDY, draft="none")
            with pytest.raises(DeviceUnavailable, match="unreachable"):
                rt.target.restart()  # the worker is still down
            ws[1].start()
            rt.target.restart()
            assert rt.target.lost is None and rt.target.tokens == []
            assert rt.generate(chat_prompts[1], GREEDY, draft="auto").token_ids == reference[1]
        finally:
            rt.close()


def test_a_stalled_link_times_out_cleanly(tmp_path, chat_prompts, reference):
    with workers(tmp_path, 1) as ws:
        rt = _split_runtime([ws[0].endpoint], rpc_timeout_s=3.0)
        try:
            ws[0].relay.pause()
            t = time.monotonic()
            with pytest.raises(DeviceUnavailable, match="no answer"):
                rt.generate(chat_prompts[2], GREEDY, draft="none")
            assert time.monotonic() - t < 15
            ws[0].relay.resume()
            rt.target.restart()
            assert rt.generate(chat_prompts[2], GREEDY, draft="none").token_ids == reference[2]
        finally:
            rt.close()
