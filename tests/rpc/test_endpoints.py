"""Endpoints, the layer split and the footprint charged to each device; the worker's bind rule."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.errors import InvalidRequest
from memspec.memory.footprint import split_footprint, target_footprint
from memspec.memory.gguf_info import read_shape
from memspec.paths import models_dir
from memspec.rpc.endpoints import is_loopback, layer_split, parse_endpoint


def test_parse_endpoint():
    assert parse_endpoint("10.0.0.2:50052") == ("10.0.0.2", 50052)
    assert parse_endpoint("worker.local:7000") == ("worker.local", 7000)
    for bad in ("host", "host:", ":80", "h:0", "h:70000", "h:port", "[::1]:7000"):
        with pytest.raises(InvalidRequest):
            parse_endpoint(bad)


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2")


def test_layer_split_sums_and_follows_the_weights():
    eps = ["a:1", "b:2"]
    s = layer_split(31, eps, [])  # default: the workers share equally, nothing local
    assert s.remote == (16, 15) and s.local == 0
    s = layer_split(31, eps, [1, 1, 1])  # a third each
    assert sum(s.remote) + s.local == 31 and s.local == 10
    s = layer_split(31, eps, [3, 1, 0])
    assert s.shares() == [("local", 0), ("a:1", 23), ("b:2", 8)]
    with pytest.raises(InvalidRequest, match="tensor_split"):
        layer_split(31, eps, [1])
    with pytest.raises(InvalidRequest):
        layer_split(31, eps, [1, -1])


def test_split_footprint_charges_each_device_its_layers():
    require_testbed()
    path = models_dir() / TARGET_FILE
    shape = read_shape(path)
    whole = target_footprint(path, 1024, 8)
    split = layer_split(shape.n_layers + 1, ["a:1", "b:2"], [1, 1, 1])
    local, remote = split_footprint(whole, shape, split)
    assert local.weights < whole.weights and local.kv < whole.kv
    assert set(remote) == {"a:1", "b:2"}
    # Every layer and KV cell is somewhere; the tied output layer is a copy on the last worker.
    total = local.weights + local.kv + sum(remote.values())
    assert total == pytest.approx(whole.weights + whole.kv + shape.token_embd_bytes, rel=1e-3)
    nothing_remote, _ = split_footprint(
        whole, shape, layer_split(shape.n_layers + 1, ["a:1"], [0, 1])
    )
    assert nothing_remote.weights == pytest.approx(whole.weights, rel=1e-3)


def test_worker_refuses_a_remote_bind_without_allow_remote():
    out = subprocess.run(
        [sys.executable, "-m", "memspec.cli", "rpc-worker", "--host", "0.0.0.0", "--port", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "no authentication" in out.stderr and "--allow-remote" in out.stderr
    assert "Traceback" not in out.stderr
