"""Shared daemon for the hostile-input, fuzz, traversal and access tests: keys on both APIs,
small limits (so oversize inputs are cheap to send), debug logging (so a leaked key would show),
and a data dir of its own with canary files outside the models directory.
"""

from __future__ import annotations

import pytest
from reliability_harness import (
    ADMIN_KEY,
    API_KEY,
    CANARIES,
    HARDENED_N_CTX,
    MAX_BODY,
    MAX_PROMPT_CHARS,
    Hardened,
    ServerProcess,
    make_data_dir,
)


@pytest.fixture(scope="session")
def hardened(tmp_path_factory) -> Hardened:
    tmp = tmp_path_factory.mktemp("hardened")
    data = make_data_dir(tmp)
    canaries = [data / CANARIES[0], data / CANARIES[1], tmp / CANARIES[2]]
    for c in canaries:
        c.write_text("canary: nothing may open this file\n")
    srv = ServerProcess(
        tmp,
        args=["--drafts", "prompt-lookup", "--n-ctx", str(HARDENED_N_CTX)],
        env={
            "MEMSPEC_DATA_DIR": str(data),
            "MEMSPEC_STATE_DIR": str(tmp / "state"),
            "MEMSPEC_API_KEY": API_KEY,
            "MEMSPEC_ADMIN_KEY": ADMIN_KEY,
            "MEMSPEC_LOG_LEVEL": "debug",
            "MEMSPEC_DEFAULT_MAX_TOKENS": "4",
            "MEMSPEC_MAX_PROMPT_CHARS": str(MAX_PROMPT_CHARS),
            "MEMSPEC_MAX_BODY": str(MAX_BODY),
        },
    )
    try:
        srv.wait_ready()
        yield Hardened(srv, data, canaries)
    finally:
        srv.stop()
