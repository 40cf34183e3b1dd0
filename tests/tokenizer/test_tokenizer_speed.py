"""Encoding throughput side by side with llama.cpp's tokenizer (llama-cpp-python ``Llama.tokenize``).

Run as a script for the full 1 MB measurement of both models:
``PYTHONPATH=src python tests/tokenizer/test_tokenizer_speed.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tok_corpus import mixed_text  # noqa: E402


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def throughput_ratio(tok, ref, n_bytes: int, repeats: int = 2) -> tuple[float, float, float]:
    """(quanta seconds, llama.cpp seconds, llama.cpp time / quanta time) encoding ``n_bytes`` of mixed text."""
    text = mixed_text(n_bytes, seed=1)
    data = text.encode()
    assert tok.encode(text) == ref.llama.tokenize(data, add_bos=True, special=False)
    ours = _best_of(lambda: tok.encode(text), repeats)
    theirs = _best_of(lambda: ref.llama.tokenize(data, add_bos=True, special=False), repeats)
    return ours, theirs, theirs / ours


@pytest.mark.slow
@pytest.mark.parametrize("name, n_bytes", [("smollm2", 1 << 20), ("gemma3", 1 << 17)])
def test_encoding_is_at_least_as_fast_as_llama_cpp(name, n_bytes, tokenizers, reference, record_property):
    ours, theirs, ratio = throughput_ratio(tokenizers[name], reference(name), n_bytes)
    record_property("throughput_ratio", ratio)
    print(f"\n{name}: {n_bytes / 2**20:.2f} MB quanta {ours:.3f} s, llama.cpp {theirs:.3f} s, ratio {ratio:.2f}")
    assert ratio >= 1.0


if __name__ == "__main__":
    from conftest import LlamaCppVocab

    from quanta.hub import resolve_model
    from quanta.tokenizer import load_tokenizer

    for model in ("smollm2-135m", "gemma3-270m"):
        path = resolve_model(model)
        start = time.perf_counter()
        tokenizer = load_tokenizer(path)
        loaded = time.perf_counter() - start
        ours, theirs, ratio = throughput_ratio(tokenizer, LlamaCppVocab(path), 1 << 20, repeats=3)
        print(f"{model}: load {loaded:.2f} s; 1 MB encode quanta {ours:.3f} s ({1 / ours:.2f} MB/s), "
              f"llama.cpp {theirs:.3f} s ({1 / theirs:.2f} MB/s), ratio {ratio:.2f}")
