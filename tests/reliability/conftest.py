"""Shared daemon for the hostile-input, fuzz, traversal and access tests: keys on both APIs,
small limits (so oversize inputs are cheap to send), debug logging (so a leaked key would show),
and a data dir of its own with canary files outside the models directory.
"""

from __future__ import annotations

import pytest
from launcher import running
from reliability_harness import (
    CANARIES,
    HARDENED_N_CTX,
    MAX_BODY,
    MAX_PROMPT_CHARS,
    Hardened,
    make_data_dir,
)


@pytest.fixture(scope="session")
def hardened(tmp_path_factory) -> Hardened:
    tmp = tmp_path_factory.mktemp("hardened")
    data = make_data_dir(tmp)
    canaries = [data / CANARIES[0], data / CANARIES[1], tmp / CANARIES[2]]
    for c in canaries:
        c.write_text("canary: nothing may open this file\n")
    env = {
        "MEMSPEC_DATA_DIR": str(data),
        "MEMSPEC_DEFAULT_MAX_TOKENS": "4",
        "MEMSPEC_MAX_PROMPT_CHARS": str(MAX_PROMPT_CHARS),
        "MEMSPEC_MAX_BODY": str(MAX_BODY),
        # A second client's /v1 key: the prefix cache is kept apart per key (test_hardening).
        "MEMSPEC_API_KEYS": '["sk-second-client-key"]',
    }
    settings = {"n_ctx": HARDENED_N_CTX, "log_level": "debug"}
    with running(tmp, "lookup", settings=settings, env=env, keys=True) as srv:
        yield Hardened(srv, data, canaries)
