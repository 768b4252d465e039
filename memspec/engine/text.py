"""Incremental detokenization with stop strings: emit only text that cannot become a stop."""

from __future__ import annotations

import codecs

from memspec.backends.base import Backend


class TextAssembler:
    """A generation's text, one token at a time. Per token it does work of the token's size,
    never of the text's: the emitted text is kept in pieces (joined once, by `text`), only the
    held-back tail is searched for stop strings, and each token's text is decoded once and
    cached (a token whose bytes end mid-character goes through the incremental decoder)."""

    def __init__(self, backend: Backend, stop: list[str]):
        self.backend = backend
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # token -> its text, for tokens that decode whole from an empty decoder state.
        self._strs: dict[int, str] = {}
        self._out: list[str] = []  # text emitted so far, in pieces
        self._tail = ""  # text not yet emitted: it could still begin a stop string

    @property
    def text(self) -> str:
        """All text so far (cut at a stop string once one is hit)."""
        return "".join(self._out) + self._tail

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return (text safe to emit now, whether a stop string was hit)."""
        piece = self._strs.get(token) if not self._decoder.buffer else None
        if piece is None:
            piece = self._decode(token)
        tail = self._tail + piece
        for s in self.stop:
            # A stop can only newly appear in the tail: anything emitted was checked already
            # and is too far back to begin one (it is at least as long as the hold-back).
            idx = tail.find(s)
            if idx >= 0:
                self._tail = tail[:idx]
                return self.flush(), True
        keep = len(tail) - self._holdback
        if keep <= 0:
            self._tail = tail
            return "", False
        delta, self._tail = tail[:keep], tail[keep:]
        self._out.append(delta)
        return delta, False

    def _decode(self, token: int) -> str:
        """The token's text through the incremental decoder; cached when it decoded whole (no
        bytes pending before or after), where the decoder's answer depends on it alone."""
        clean = not self._decoder.buffer
        piece = self._decoder.decode(self.backend.detokenize([token]))
        if clean and not self._decoder.buffer:
            self._strs[token] = piece
        return piece

    def flush(self) -> str:
        """Emit what was held back (the generation is over)."""
        delta, self._tail = self._tail, ""
        if delta:
            self._out.append(delta)
        return delta
