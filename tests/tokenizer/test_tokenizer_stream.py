"""Streaming detokenization: pieces concatenate to exactly the full decode, and never hold a broken character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tok_corpus import SAMPLES

NAMES = ["smollm2", "gemma3", "synth-gpt-2", "synth-spm"]


def _interesting_ids(tok) -> list[int]:
    """Byte tokens, specials, and tokens made only of the characters the space clean-up looks at."""
    pieces = tok.pieces
    ids = [i for i, p in enumerate(pieces) if len(p) == 1 and (p[0] >= 0x80 or chr(p[0]) in " '?!.,smrev")]
    ids += [i for i, p in enumerate(pieces) if p and set(p) <= set(b" '?!.,smrev")][:200]
    ids += list(tok.vocab.special_tokens[:50])
    return ids


def _ids_strategy(tok):
    interesting = _interesting_ids(tok)
    one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(interesting))
    return st.lists(one, max_size=40)


def _stream(tok, ids, skip_special):
    dec = tok.stream_decoder(skip_special=skip_special)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("name", NAMES)
def test_stream_pieces_concatenate_to_decode(name, tokenizers):
    tok = tokenizers[name]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ids=_ids_strategy(tok), skip_special=st.booleans())
    def check(ids, skip_special):
        pieces = _stream(tok, ids, skip_special)
        full = tok.decode(ids, skip_special=skip_special)
        assert "".join(pieces) == full
        if "\ufffd" not in full:  # no replacement character is ever emitted early for a split character
            assert not any("\ufffd" in p for p in pieces)

    check()


@pytest.mark.parametrize("name", NAMES)
def test_stream_of_encoded_text_yields_the_text_incrementally(name, tokenizers):
    tok = tokenizers[name]
    for text in SAMPLES:
        ids = tok.encode(text, add_special=False, parse_special=True)
        pieces = _stream(tok, ids, skip_special=False)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_stream_holds_a_split_character_until_complete(tokenizers):
    tok = tokenizers["gemma3"]
    byte = {tok.vocab.tokens.index(f"<0x{b:02X}>"): b for b in (0xF0, 0x9F, 0x98, 0x80)}
    ids = list(byte)
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids] == ["", "", "", "\U0001F600"]
    assert dec.flush() == ""
