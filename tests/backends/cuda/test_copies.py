"""The copies of activations that producers write for the next matmul: prefill's bf16 operand of the GEMM in the
word order of 4-bit or of 8-bit codes, from the norm, the gated activations and the attention, against
gemm.word_order of their float outputs; and a whole prefill with the copies against the same prefill without them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from batches import placement, run_steps
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cuda import activation, attention, norm
from quanta.backends.cuda.gemm import WordsCopy, word_order
from quanta.models import load_model


def _words(x: torch.Tensor, kind: str) -> WordsCopy:
    return WordsCopy(torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=x.device), kind)


def _same(words: WordsCopy, out: torch.Tensor) -> None:
    """``words`` is ``out`` permuted as the GEMM reads it and rounded to bf16 as torch's cast rounds."""
    assert torch.equal(words.data, word_order(out, words.kind, torch.bfloat16))


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_norm_and_activation_write_the_gemm_operand(kind: str, device: str) -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((6, 96)).astype(np.float32)).to(device)
    w = torch.from_numpy(rng.standard_normal(96).astype(np.float32)).to(device)
    words = _words(x, kind)
    out = norm.rms_norm(x, w, 1e-5, words=words)
    _same(words, out)
    g, u = (torch.from_numpy(rng.standard_normal((5, 224)).astype(np.float32)).to(device) for _ in range(2))
    for op in (activation.silu_mul, activation.gelu_mul):
        words = _words(g, kind)
        out = op(g, u, words=words)
        _same(words, out)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_prefill_attention_writes_the_gemm_operand(kind: str, device: str) -> None:
    rng = np.random.default_rng(1)
    n, h, hkv, hd, n_slots = 7, 4, 2, 32, 16
    q = torch.from_numpy(rng.standard_normal((n, h, hd)).astype(np.float32)).to(device)
    kc, vc = (torch.from_numpy(rng.standard_normal((hkv, n_slots, hd)).astype(np.float32)).to(device)
              for _ in range(2))
    host = placement([([2, 0, 3], 3, 4), ([1], 0, 3)], 4)  # two sequences' chunks
    meta = type(host)(*(torch.from_numpy(getattr(host, f)).to(device) for f in
                        ("positions", "slots", "token_seq", "block_tables", "seq_lens", "query_starts")),
                      host.n_seqs, host.max_query_len, host.block_size)
    out = torch.empty((n, h * hd), device=device)
    words = _words(out, kind)
    attention.attention(q, kc, vc, meta, scale=hd**-0.5, out=out, words=words)
    _same(words, out)


# 4-bit codes in most matrices: copies in their word order; head_dim 32: the attention writes one too
FOUR_BIT = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_K",
            "ffn_up": "Q4_K", "ffn_down": "Q5_K", "token_embd": "Q4_K"}
EIGHT_BIT = {"output": "Q8_0"}  # every matrix Q8_0: copies in the 8-bit word order
MIXED = {**FOUR_BIT, "ffn_down": "Q8_0", "attn_v": "Q8_0", "output": "Q8_0"}  # 4-bit: 6 of 9


@pytest.mark.parametrize("arch,types", [("llama", FOUR_BIT), ("gemma3", FOUR_BIT), ("llama", EIGHT_BIT),
                                        ("llama", MIXED)])
def test_prefill_with_copies_equals_prefill_without(arch: str, types: dict, tmp_path: Path, device: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from quanta.backends.cuda import gemm
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_heads=8,
                            head_dim=32, n_layers=1)
    be = CUDABackend(device, graphs=False, q8=False)  # without int8 activations: a short prompt takes the GEMM
    model = load_model(gguf.open(path), be, 32)
    permuted = []
    monkeypatch.setattr(gemm, "word_order", lambda x, *a, _f=gemm.word_order: permuted.append(1) or _f(x, *a))
    prompt = list(range(3, 12))
    logits = {}
    for with_copies in (True, False):
        be._copies.words = with_copies
        permuted.clear()
        logits[with_copies] = run_steps(be, model, [prompt], [[(0, 0, 9)]])[0]
        calls = len(permuted)
        if with_copies:  # every GEMM of the copies' kind read its producer's copy
            assert calls == (3 if types is MIXED else 0)  # MIXED: v, down and the lm head permute x themselves
        else:
            assert calls >= 4 * model.config.n_layers  # q|k, v, o, gate|up, down: all permuted x themselves
    np.testing.assert_array_equal(logits[True], logits[False])  # the same bf16 operands: the same logits
