"""Stop strings across streamed pieces: nothing that turns out to be part of a stop string is emitted."""

from __future__ import annotations

from quanta.engine.stop import StopMatcher


def feed(stops, pieces):
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_stop_split_over_pieces():
    out, stopped = feed(["END"], ["Hello E", "N", "D and more"])
    assert "".join(out) == "Hello " and stopped
    assert out[0] == "Hello "  # the 'E' was held back


def test_false_alarm_is_released():
    out, stopped = feed(["END"], ["a E", "x", "N"])
    assert "".join(out) == "a ExN" and not stopped


def test_earliest_of_several_stops():
    out, stopped = feed(["\n\n", "bar"], ["foo bar\n\nbaz"])
    assert "".join(out) == "foo " and stopped


def test_no_stops_passes_through():
    assert feed([], ["a", "b"]) == (["a", "b", ""], False)


def test_nothing_after_stop():
    m = StopMatcher(["x"])
    assert m.push("axb") == "a" and m.push("more") == "" and m.flush() == ""
