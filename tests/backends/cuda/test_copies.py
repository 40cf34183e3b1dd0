"""The copies of activations that producers write for the next matmul: prefill's bf16 operand of the GEMM in the
word order of 4-bit codes, from the norm, the gated activations and the attention, against gemm.word_order of
their float outputs; and a whole prefill with the copies against the same prefill without them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cuda import activation, attention, norm
from quanta.backends.cuda.gemm import word_order
from quanta.models import load_model


def _words(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=x.device)


def _same(words: torch.Tensor, out: torch.Tensor) -> None:
    """``words`` is ``out`` permuted as the GEMM reads it and rounded to bf16 as torch's cast rounds."""
    assert torch.equal(words, word_order(out, "q4", torch.bfloat16))


def test_norm_and_activation_write_the_gemm_operand(device: str) -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((6, 96)).astype(np.float32)).to(device)
    w = torch.from_numpy(rng.standard_normal(96).astype(np.float32)).to(device)
    words = _words(x)
    out = norm.rms_norm(x, w, 1e-5, words=words)
    _same(words, out)
    g, u = (torch.from_numpy(rng.standard_normal((5, 224)).astype(np.float32)).to(device) for _ in range(2))
    for op in (activation.silu_mul, activation.gelu_mul):
        words = _words(g)
        out = op(g, u, words=words)
        _same(words, out)


def test_prefill_attention_writes_the_gemm_operand(device: str) -> None:
    rng = np.random.default_rng(1)
    n, h, hkv, hd, n_ctx = 7, 4, 2, 32, 16
    q = torch.from_numpy(rng.standard_normal((n, h, hd)).astype(np.float32)).to(device)
    kc, vc = (torch.from_numpy(rng.standard_normal((hkv, n_ctx, hd)).astype(np.float32)).to(device)
              for _ in range(2))
    positions = torch.arange(3, 3 + n, dtype=torch.int32, device=device)
    out = torch.empty((n, h * hd), device=device)
    words = _words(out)
    attention.attention(q, kc, vc, positions, scale=hd**-0.5, out=out, words=words)
    _same(words, out)


# 4-bit codes in most matrices (the copies are made only then); head_dim 32: the attention writes one too
FOUR_BIT = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_K",
            "ffn_up": "Q4_K", "ffn_down": "Q5_K", "token_embd": "Q4_K"}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_with_copies_equals_prefill_without(arch: str, tmp_path: Path, device: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from quanta.backends.cuda import gemm
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=FOUR_BIT, d_model=256, d_ff=256, n_heads=8,
                            head_dim=32)
    be = CUDABackend(device, graphs=False)
    model = load_model(gguf.open(path), be, 32)
    permuted = []
    monkeypatch.setattr(gemm, "word_order", lambda x, *a, _f=gemm.word_order: permuted.append(1) or _f(x, *a))
    prompt = np.arange(3, 12, dtype=np.int32)
    logits = {}
    for with_copies in (True, False):
        be._copies.words = with_copies
        permuted.clear()
        cache = be.kv_cache(model.kv_shape())
        logits[with_copies] = be.to_host(be.forward(model, prompt, 0, cache, all_logits=True)).copy()
        calls = len(permuted)
        if with_copies:
            assert calls == 0  # every GEMM read its producer's copy
        else:
            assert calls >= 4 * model.config.n_layers  # q|k, v, o, gate|up, down: all permuted x themselves
    np.testing.assert_array_equal(logits[True], logits[False])  # the same bf16 operands: the same logits
