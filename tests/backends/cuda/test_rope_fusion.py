"""Decode with rope and the KV store done in the Q/K/V GEMVs' epilogue (``CUDABackend.qkv_rope``) against the same
step with the projections followed by ``rope_qk`` (tested against numpy in test_ops.py): the rotated queries, the
pool rows written at each token's slot, the logits; one sequence and a batch of two. Llama's adjacent pairs and
qwen2's halves (NEOX, with biases), every grouping of Q/K/V into fused matmuls, 8-bit and 4-bit tiles, the float
GEMV (exact) and the int8 ones (one row; the batched GEMV, whose row tiles are always even)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from batches import BLOCK, TABLES, run_steps
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


def _decode(be, model, fuse: bool, rows: int) -> tuple[np.ndarray, ...]:
    """Prefill ``rows`` sequences of 5 tokens, then decode one token of each in one batch: its logits, q, and the
    K/V pool rows of the decoded tokens' slots."""
    taken: list[bool] = []
    fused_op = type(be).qkv_rope

    def qkv_rope(*args, **kwargs) -> bool:
        taken.append(fuse and fused_op(be, *args, **kwargs))
        return taken[-1]

    be.qkv_rope = qkv_rope
    tokens = [[1 + j, 5, 7, 9, 11, 3 + j] for j in range(rows)]
    logits = run_steps(be, model, tokens, [[(j, 0, 5) for j in range(rows)], [(j, 5, 1) for j in range(rows)]],
                       TABLES[:rows])[-1]
    c = model.config
    q = be.buffer("q", (rows, c.n_heads * c.head_dim))
    slots = [TABLES[j][5 // BLOCK] * BLOCK + 5 % BLOCK for j in range(rows)]
    k, v = (be.to_host(pool[0][:, slots].float()).copy() for pool in (be.last_pool.k, be.last_pool.v))
    return logits, be.to_host(q).copy(), k, v, any(taken)


@pytest.mark.parametrize("arch,types,shape,fits,exact,rows",
                         [(*c, exact, 1) for c in CASES for exact in (True, False)] + [(*FALLBACK, True, 1)]
                         + [(*CASES[0], False, 2), (*CASES[2], False, 2), (*CASES[0], True, 2)])
def test_rope_in_the_qkv_epilogue(arch: str, types: dict, shape: dict, fits: bool, exact: bool, rows: int,
                                  tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from quanta.backends.cuda import q8gemv, qmatmul
    from quanta.backends.cuda.backend import CUDABackend

    if device == "cpu":  # wide tiles of the same parity: the interpreter runs the programs one by one
        for table in (qmatmul.GEMV_CONFIG, q8gemv.Q8_CONFIG):
            for key, cfg in list(table.items()):
                monkeypatch.setitem(table, key, {"BN": 32 if cfg["BN"] % 2 == 0 else 1, "BJ": 8, "num_warps": 1})
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_layers=1,
                            vocab=64, **shape)
    be = CUDABackend(device, exact=exact)
    kv_cache = be.kv_cache
    be.kv_cache = lambda shape, dtype="auto": setattr(be, "last_pool", kv_cache(shape, dtype)) or be.last_pool
    model = load_model(gguf.open(path), be, 32)
    *fused, taken = _decode(be, model, fuse=True, rows=rows)
    *plain, taken_plain = _decode(be, model, fuse=False, rows=rows)
    assert taken == fits and not taken_plain
    for name, got, want in zip(("logits", "q", "k rows", "v rows"), fused, plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(fused[2]).max() > 0  # the step wrote its key rows
