"""Presets against the published Hugging Face configs and parameter counts, and against the real GGUF files."""

from __future__ import annotations

import numpy as np
import pytest

from quanta.gguf import open_gguf
from quanta.synth import PRESETS, get_preset, synthesize, tensor_shapes

# name: (hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied, context, rope theta, published params)
HF_CONFIGS = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, True, 8192, 100000.0, 134_515_008),
    "gemma3-270m": (640, 2048, 18, 4, 1, 256, 262144, True, 32768, 1_000_000.0, 268_098_176),
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 64, 32000, False, 2048, 10000.0, 1_100_048_384),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64, 128256, True, 131072, 500000.0, 1_235_814_400),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 64, 151936, True, 32768, 1_000_000.0, 494_032_768),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True, 32768, 1_000_000.0, 1_543_714_304),
    "llama-2-7b": (4096, 11008, 32, 32, 32, 128, 32000, False, 4096, 10000.0, 6_738_415_616),
    "llama-2-13b": (5120, 13824, 40, 40, 40, 128, 32000, False, 4096, 10000.0, 13_015_864_320),
}


def test_every_preset_is_listed():
    assert set(PRESETS) == set(HF_CONFIGS)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_full_size_shapes_match_the_published_config(name):
    hidden, ff, layers, heads, kv, hd, vocab, tied, ctx, theta, n_params = HF_CONFIGS[name]
    p = get_preset(name)
    shapes = dict(tensor_shapes(p))
    assert shapes["token_embd.weight"] == (vocab, hidden)
    assert ("output.weight" in shapes) == (not tied)
    assert shapes[f"blk.{layers - 1}.attn_q.weight"] == (heads * hd, hidden)
    assert shapes[f"blk.{layers - 1}.attn_k.weight"] == (kv * hd, hidden)
    assert shapes[f"blk.{layers - 1}.attn_output.weight"] == (hidden, heads * hd)
    assert shapes["blk.0.ffn_down.weight"] == (hidden, ff)
    assert f"blk.{layers}.attn_q.weight" not in shapes
    assert p.context_length == ctx and p.rope_freq_base == theta
    total = sum(int(np.prod(s)) for n, s in shapes.items() if n != "rope_freqs.weight")
    assert total == n_params


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_small_variant_opens_in_our_reader_with_the_right_shapes(name, tmp_path):
    p = get_preset(name).with_overrides(layers=2, vocab=1024)
    path = tmp_path / "m.gguf"
    synthesize(p, path, "Q4_0", progress=False)
    hidden, ff, _, heads, kv, hd, _, tied, ctx, theta, _ = HF_CONFIGS[name]
    with open_gguf(path) as f:
        a = f.architecture
        assert a == {"gemma3-270m": "gemma3", "qwen2.5-0.5b": "qwen2", "qwen2.5-1.5b": "qwen2"}.get(name, "llama")
        assert f.metadata[f"{a}.block_count"] == 2 and f.metadata[f"{a}.embedding_length"] == hidden
        assert f.metadata[f"{a}.attention.head_count"] == heads and f.metadata[f"{a}.attention.head_count_kv"] == kv
        assert f.metadata[f"{a}.context_length"] == ctx
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 1024
        assert {t.name: t.shape for t in f.tensors.values()} == dict(tensor_shapes(p))
        assert f.tensors["blk.1.ffn_gate.weight"].shape == (ff, hidden)
        assert all(t.type == "F32" for t in f.tensors.values() if len(t.shape) == 1)


@pytest.mark.parametrize("model,name", [("smollm2_path", "smollm2-135m"), ("gemma3_path", "gemma3-270m")])
def test_synth_matches_the_real_file(model, name, request, tmp_path):
    """Same tensor names and shapes, same architecture metadata and tokenizer kind as the real model."""
    real = request.getfixturevalue(model)
    with open_gguf(real) as f:
        real_shapes = {t.name: t.shape for t in f.tensors.values()}
        real_md = dict(f.metadata)
    p = get_preset(name).with_overrides(vocab=4096)
    assert dict(tensor_shapes(get_preset(name))) == real_shapes
    path = tmp_path / "s.gguf"
    synthesize(p.with_overrides(layers=1), path, "Q8_0", progress=False)
    with open_gguf(path) as f:
        a = real_md["general.architecture"]
        assert f.architecture == a
        for key, value in real_md.items():
            if key.startswith(a + ".") and key not in (f"{a}.block_count", f"{a}.vocab_size"):
                assert key in f.metadata, key
                assert f.metadata[key] == pytest.approx(value), key
        for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                    "tokenizer.ggml.add_space_prefix"):
            assert f.metadata.get(key) == real_md.get(key), key
        if "tokenizer.chat_template" in real_md:
            assert f.metadata["tokenizer.chat_template"] == real_md["tokenizer.chat_template"]
        real_tokens = real_md["tokenizer.ggml.tokens"]
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            assert f.metadata["tokenizer.ggml.tokens"][f.metadata[key]] == real_tokens[real_md[key]]


def test_llama32_rope_freqs_follow_the_llama3_scaling_rule(tmp_path):
    p = get_preset("llama-3.2-1b").with_overrides(layers=1, vocab=1024)
    synthesize(p, tmp_path / "l.gguf", "Q8_0", progress=False)
    with open_gguf(tmp_path / "l.gguf") as f:
        factors = f.tensors["rope_freqs.weight"].raw.view(np.float32)
    assert factors.shape == (32,)
    # high frequencies unscaled, low frequencies scaled by the factor 32, smooth in between
    assert factors[0] == 1.0 and factors[-1] == 32.0 and np.all(np.diff(factors) >= 0)


def test_synthesis_streams_one_tensor_at_a_time(tmp_path):
    """Peak Python allocation stays near the largest tensor, far below the file (the 7B preset fits in RAM)."""
    import tracemalloc

    p = get_preset("llama-2-7b").with_overrides(layers=2, vocab=4096)
    tracemalloc.start()
    result = synthesize(p, tmp_path / "big.gguf", "Q4_K_M", progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    largest = 11008 * 4096 * 210 // 256  # an ffn tensor in Q6_K
    assert result.bytes > 5 * largest
    assert peak < 2.5 * largest, (peak, largest)
