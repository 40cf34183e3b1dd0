"""Prefill attention on the GPU: µs per call (CUDA graph) of the causal flash-attention kernel on the fp16 cache
of the default mode, with tf32 dots on upcast tiles (before session 15) and with fp16 dots in several tiles, for
the benchmark models' head shapes at 512 and 2,048 prompt tokens; max difference against the tf32 output.

Usage (repo root, GPU machine): PYTHONPATH=src python3 scripts/gpu_prefill_attn.py   (GPU journal, run 129)
"""

from __future__ import annotations

import functools
import sys

import torch
import triton

sys.path.insert(0, "scripts")
from gpu_timing import graph_seconds

from quanta.backends.cuda import attention as A

SHAPES = [  # name, heads, kv heads, head dim, window
    ("TinyLlama 32/4/64", 32, 4, 64, 0), ("Llama-3.2 32/8/64", 32, 8, 64, 0), ("Qwen2.5 12/2/128", 12, 2, 128, 0),
    ("Gemma-3 4/1/256 w512", 4, 1, 256, 512), ("Gemma-3 4/1/256", 4, 1, 256, 0),
]
TILES = {  # BM, BN, warps, stages
    "narrow": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2)],
    "wide": [(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2)],
}


def call(q, kc, vc, pos, out, *, h, hkv, hd, window, dot, tile):
    n = q.shape[0]
    bm, bn, warps, stages = tile
    A._prefill_attention_kernel[(triton.cdiv(n, bm), h)](
        q, kc, vc, pos, out, out, n, h, hkv, hd, kc.shape[1], hd ** -0.5, 1.0, window, SOFTCAP=False,
        WINDOW=window > 0, BM=bm, BN=bn, BD=hd, DOT=dot, WORDS=False, NW=4, num_warps=warps, num_stages=stages)


def row(h: int, hkv: int, hd: int, window: int, n: int) -> list[str]:
    """Timings of one shape and prompt length: tf32 with the old tile, then fp16 with each tile."""
    kc, vc = (torch.randn(hkv, 4096, hd, device="cuda").half() for _ in range(2))
    q = torch.randn(n, h, hd, device="cuda")
    pos = torch.arange(n, dtype=torch.int32, device="cuda")
    ref = torch.empty(n, h * hd, device="cuda")
    out = torch.empty_like(ref)
    tiles = TILES["wide" if hd > 128 else "narrow"]
    run = functools.partial(call, q, kc, vc, pos, h=h, hkv=hkv, hd=hd, window=window)
    run(ref, dot="tf32", tile=tiles[0])
    cells = [f"tf32 {tiles[0]}: {graph_seconds([lambda: run(ref, dot='tf32', tile=tiles[0])] * 5) * 1e6:.1f}"]
    for tile in tiles:
        try:
            run(out, dot="fp16", tile=tile)
            err = float((out - ref).abs().max())
            t = graph_seconds([lambda tile=tile: run(out, dot="fp16", tile=tile)] * 5)
            cells.append(f"fp16 {tile}: {t * 1e6:.1f} (diff {err:.0e})")
        except Exception as e:  # noqa: BLE001 (a tile that does not fit shared memory)
            cells.append(f"fp16 {tile}: {type(e).__name__}")
    return cells


def main() -> None:
    torch.manual_seed(0)
    for name, h, hkv, hd, window in SHAPES:
        for n in (512, 2048):
            print(f"{name:22s} n={n:5d} | " + " | ".join(row(h, hkv, hd, window, n)), flush=True)


if __name__ == "__main__":
    main()
