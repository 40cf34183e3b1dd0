"""Decode with rope and the KV store done in the Q/K/V GEMVs' epilogue (``CUDABackend.qkv_rope``) against the same
step with the projections followed by ``rope_qk`` (tested against numpy in test_ops.py): the rotated queries, the
cache rows written, the logits. Llama's adjacent pairs and qwen2's halves (NEOX, with biases), every grouping of
Q/K/V into fused matmuls, 8-bit and 4-bit tiles, the float GEMV (exact) and the int8 one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.models import load_model

WIDE = dict(n_heads=16, n_kv_heads=2, head_dim=64)  # q|k of 1,152 rows: the 4-bit "base" tile (an even BN > 2)
CASES = [  # arch, matrix types, shape, whether the GEMV tiles allow the fusion
    ("llama", {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q6_K"}, {}, True),  # q|k fused, v alone
    ("llama", {"attn_q": "Q6_K", "attn_k": "Q8_0", "attn_v": "Q8_0"}, {}, True),  # q alone, k|v fused
    ("qwen2", {}, {}, True),  # q|k|v fused with biases, NEOX pairs
    ("qwen2", {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q8_0"}, WIDE, True),
]
FALLBACK = ("llama", {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K"}, {}, False)  # q: 4-bit tile of one row


def _decode(be, model, fuse: bool) -> tuple[np.ndarray, ...]:
    """Prefill 5 tokens, decode one: its logits, q, and the K/V cache rows at position 5."""
    taken: list[bool] = []
    fused_op = type(be).qkv_rope

    def qkv_rope(*args, **kwargs) -> bool:
        taken.append(fuse and fused_op(be, *args, **kwargs))
        return taken[-1]

    be.qkv_rope = qkv_rope
    cache = be.kv_cache(model.kv_shape())
    be.forward(model, np.asarray([1, 5, 7, 9, 11], np.int32), 0, cache, all_logits=False)
    logits = be.forward(model, np.asarray([3], np.int32), 5, cache, all_logits=False)
    c = model.config
    q = be.buffer("q", (1, c.n_heads * c.head_dim))
    k, v = cache[0]
    return (be.to_host(logits).copy(), be.to_host(q).copy(), be.to_host(k[:, 5].float()).copy(),
            be.to_host(v[:, 5].float()).copy(), any(taken))


@pytest.mark.parametrize("arch,types,shape,fits,exact", [(*c, exact) for c in CASES for exact in (True, False)]
                         + [(*FALLBACK, True)])
def test_rope_in_the_qkv_epilogue(arch: str, types: dict, shape: dict, fits: bool, exact: bool, tmp_path: Path,
                                  device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_layers=1,
                            vocab=64, **shape)
    be = CUDABackend(device, exact=exact)
    model = load_model(gguf.open(path), be, 32)
    *fused, taken = _decode(be, model, fuse=True)
    *plain, taken_plain = _decode(be, model, fuse=False)
    assert taken == fits and not taken_plain
    for name, got, want in zip(("logits", "q", "k row", "v row"), fused, plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(fused[2]).max() > 0  # the step wrote its key row
