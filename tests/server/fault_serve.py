"""`memspec serve` with faults injected on purpose, for the reliability tests only.

A prompt containing one of these markers triggers its fault inside Runtime.generate, on the
engine thread, exactly where a real engine failure would happen:

    FAULT:raise      raise before the first token (the request gets a clean 500)
    FAULT:midstream  raise at the third token (the stream ends with an error event)
    FAULT:slow       sleep 0.1 s per token (holds the engine: queue and disconnect tests)
    FAULT:hang       never return (a stuck engine: watchdog pings must stop)

and FAULT_LOAD_DELAY_S=N in the environment makes loading the models take N s longer.
Everything else is the real daemon.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from memspec.runtime import Runtime

_generate = Runtime.generate


def generate(self, prompt, params, *args, **kwargs):  # noqa: ANN001, ANN201 - a patch
    text = self.target.detokenize(prompt).decode("utf-8", errors="replace")
    if "FAULT:raise" in text:
        raise RuntimeError("injected engine fault")
    if "FAULT:hang" in text:
        threading.Event().wait()
    on_token = kwargs.get("on_token")
    if on_token is not None and ("FAULT:midstream" in text or "FAULT:slow" in text):
        count = [0]
        midstream = "FAULT:midstream" in text

        def faulty(delta: str, token: int | None) -> None:
            count[0] += 1
            if midstream and count[0] == 3:
                raise RuntimeError("injected engine fault mid-stream")
            if not midstream:
                time.sleep(0.1)
            on_token(delta, token)

        kwargs["on_token"] = faulty
    return _generate(self, prompt, params, *args, **kwargs)


_init = Runtime.__init__


def init(self, *args, **kwargs):  # noqa: ANN001, ANN201 - a patch
    time.sleep(float(os.environ.get("FAULT_LOAD_DELAY_S", "0")))
    _init(self, *args, **kwargs)


Runtime.generate = generate  # type: ignore[method-assign]
Runtime.__init__ = init  # type: ignore[method-assign]

if __name__ == "__main__":
    from memspec.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
