"""Loading: the config comes from GGUF metadata; unknown architectures fail with a message naming them."""

from __future__ import annotations

import numpy as np
import pytest

import quanta.gguf as gguf
from quanta.errors import UnsupportedModelError
from quanta.gguf import TensorToWrite, write_gguf
from quanta.models import ARCHITECTURES, ModelConfig, model_class


def test_supported_architectures():
    assert set(ARCHITECTURES) == {"llama", "qwen2", "gemma3"}


def test_unsupported_architecture_message(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, {"general.architecture": "mamba"},
               [TensorToWrite("token_embd.weight", "F32", (4, 8), np.zeros((4, 8), np.float32))])
    from quanta.api import LLM

    with pytest.raises(UnsupportedModelError, match="'mamba'.*gemma3, llama, qwen2"):
        LLM(path)
    with pytest.raises(UnsupportedModelError):
        model_class("gpt2")


def test_config_from_real_metadata(smollm2_path, gemma3_path):
    with gguf.open(smollm2_path) as f:
        c = ModelConfig.from_metadata(f.metadata, 49152)
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert c.rope_base == 100000.0 and c.sliding_window == 0
    with gguf.open(gemma3_path) as f:
        g = ModelConfig.from_metadata(f.metadata, 262144)
    assert (g.head_dim, g.n_heads, g.n_kv_heads, g.sliding_window) == (256, 4, 1, 512)
    assert g.attn_scale == pytest.approx(1 / 16)


def test_gemma3_sliding_pattern(gemma3_path):
    from quanta.api import LLM

    llm = LLM(gemma3_path, n_ctx=64)
    assert [i for i in range(18) if not llm.model.is_sliding(i)] == [5, 11, 17]
