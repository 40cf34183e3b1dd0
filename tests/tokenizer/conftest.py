"""Fixtures for tokenizer tests: the real models, synthetic vocab-only GGUFs, llama.cpp as the reference."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest

from quanta.tokenizer import Tokenizer, load_tokenizer

from tok_synthetic import write_bpe_vocab, write_spm_vocab

SYNTHETIC_BPE = ("llama-bpe", "qwen2", "gpt-2", "smollm", "default")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="session")
def model_paths(smollm2_path: Path, gemma3_path: Path, synthetic_dir: Path) -> dict[str, Path]:
    """Every vocabulary the parity tests cover, by name."""
    paths = {"smollm2": smollm2_path, "gemma3": gemma3_path}
    for pre in SYNTHETIC_BPE:
        paths[f"synth-{pre}"] = write_bpe_vocab(synthetic_dir / f"bpe-{pre}.gguf", pre)
    paths["synth-spm"] = write_spm_vocab(synthetic_dir / "spm.gguf")
    return paths


@pytest.fixture(scope="session")
def tokenizers(model_paths: dict[str, Path], synthetic_dir: Path) -> dict[str, Tokenizer]:
    return {name: load_tokenizer(path, cache_dir=synthetic_dir / "cache") for name, path in model_paths.items()}


class LlamaCppVocab:
    """llama.cpp's tokenizer through llama-cpp-python (vocab only): the reference every id is checked against."""

    def __init__(self, path: Path):
        llama_cpp = pytest.importorskip("llama_cpp")
        self.lib = llama_cpp
        self.llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llama.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.llama.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def detokenize(self, ids: list[int], special: bool) -> bytes:
        arr = (self.lib.llama_token * max(len(ids), 1))(*ids)
        size = 256 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, size, False, special)
        assert n >= 0
        return buf.raw[:n]

    def n_tokens(self) -> int:
        return self.lib.llama_vocab_n_tokens(self.vocab)

    def is_eog(self, token_id: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token_id))

    def attr(self, token_id: int) -> int:
        return int(self.lib.llama_vocab_get_attr(self.vocab, token_id))


@pytest.fixture(scope="session")
def reference(model_paths: dict[str, Path]):
    """``reference(name)``: llama.cpp's tokenizer for that vocabulary (loaded once)."""
    return functools.lru_cache(maxsize=None)(lambda name: LlamaCppVocab(model_paths[name]))
