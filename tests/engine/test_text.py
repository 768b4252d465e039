"""TextAssembler: per token, work of the token's size (each token's text decoded once, the
emitted text never rebuilt), with exactly the deltas and stops the whole-text version gave."""

from __future__ import annotations

import codecs
import random

from memspec.engine.text import TextAssembler

# Pieces a byte-level tokenizer hands out: whole words, a multi-byte character split over two
# and three tokens, an invalid byte, and the pieces of the stop strings below.
PIECES = [
    b" the", b" cat", b"\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xf0\x9f", b"\x98",
    b"\x80", b"</", b"s>", b"END", b"E", b"ND", b"x", b"", b"\xff",
]  # fmt: skip


class Pieces:
    """The part of a Backend TextAssembler reads, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def detokenize(self, tokens: list[int]) -> bytes:
        self.calls += 1
        return b"".join(PIECES[t] for t in tokens)


class WholeText:
    """The previous TextAssembler: the whole text rebuilt and searched from near the end."""

    def __init__(self, backend: Pieces, stop: list[str]):
        self.backend = backend
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self._emitted = 0

    def push(self, token: int) -> tuple[str, bool]:
        self.text += self._decoder.decode(self.backend.detokenize([token]))
        for s in self.stop:
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


def run(assembler: TextAssembler | WholeText, tokens: list[int]) -> tuple[list, str]:
    out = []
    for t in tokens:
        delta, hit = assembler.push(t)
        out.append((delta, hit))
        if hit:
            break
    out.append((assembler.flush(), None))
    return out, assembler.text


def test_same_deltas_and_stops_as_the_whole_text():
    rng = random.Random(0)
    stops_choices = [[], ["</s>"], ["END", "\n\n"], ["é", "cat the"], ["€x"], ["a", "</s>"]]
    for trial in range(400):
        tokens = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 60))]
        stop = stops_choices[trial % len(stops_choices)]
        new, old = TextAssembler(Pieces(), stop), WholeText(Pieces(), stop)  # type: ignore[arg-type]
        assert run(new, tokens) == run(old, tokens), (tokens, stop)


def test_each_token_is_decoded_once():
    """The backend is asked for a token's bytes once; tokens that end or continue a split
    character (3 and 4, the two bytes of é) are decoded every time: their text depends on
    their neighbours."""
    backend = Pieces()
    text = TextAssembler(backend, [])  # type: ignore[arg-type]
    for t in [0, 1, 0, 1, 2, 0, 1, 2]:
        text.push(t)
    assert backend.calls == 3
    for t in [3, 4, 3, 4]:
        text.push(t)
    assert backend.calls == 3 + 4
    assert text.text == " the cat the cat\n the cat\néé"


def test_emitted_text_is_never_rebuilt():
    """Pushing a token appends its delta; the text so far is joined only when asked for."""
    text = TextAssembler(Pieces(), ["END"])  # type: ignore[arg-type]
    for _ in range(1000):
        text.push(0)
    # One piece per token's delta (a token's length, the hold-back shifting it by two).
    assert len(text._out) == 1000 and all(len(piece) == 4 for piece in text._out[1:])
    assert text._tail == "he"  # the hold-back, never more
    assert text.text == " the" * 1000
