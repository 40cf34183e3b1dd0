"""Stop strings over streamed text: hold back any tail that could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces; get back the text that is safe to emit. ``stopped`` turns True on a full match,
    after which nothing more is emitted (the stop string itself never is)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if not self.stops:
            return piece
        if self.stopped:
            return ""
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return text[: min(hits)]
        hold = self._partial_tail(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
