"""Incremental detokenization with stop strings: emit only text that cannot become a stop."""

from __future__ import annotations

import codecs

from memspec.backends.base import Backend


class TextAssembler:
    def __init__(self, backend: Backend, stop: list[str]):
        self.backend = backend
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # all text so far (cut at a stop string once one is hit)
        self._emitted = 0

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return (text safe to emit now, whether a stop string was hit)."""
        self.text += self._decoder.decode(self.backend.detokenize([token]))
        for s in self.stop:
            # A stop can only newly appear in the tail: search from where it could start.
            idx = self.text.find(s, max(0, self._emitted - len(s)))
            if idx >= 0:
                self.text = self.text[:idx]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self._holdback), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
