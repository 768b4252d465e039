"""`memspec bench load|soak` before any traffic: a daemon that is not there is one clear line."""

from __future__ import annotations

import socket

import pytest

from memspec_lab.bench.load import main


def test_load_without_a_daemon_says_so():
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SystemExit) as exc:
        main(["load", "--url", url, "--clients", "1", "--seconds", "1"])
    assert f"no daemon answers at {url}" in str(exc.value)
    assert "memspec serve" in str(exc.value)
