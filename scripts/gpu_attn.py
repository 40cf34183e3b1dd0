"""Decode attention on the GPU: per-call µs inside a CUDA graph and max error against a torch float64 softmax
attention (over the cache as stored), for the benchmark models' head shapes at depths 100, 1024 and 4096: the
exact mode's config (fp32 cache, IEEE dots), the default mode's (fp16 cache, fp16 tensor-core dots) and variants.

Each timed graph holds LAYERS calls, each over its own random K/V cache (as the layers of a decode step, so the
caches do not all sit in L2). Table to stdout and to $OUT/gpu_attn.log when $OUT is set.
Usage (repo root, GPU machine): PYTHONPATH=src python3 scripts/gpu_attn.py
"""

from __future__ import annotations

import os
import time

import torch

from gpu_timing import graph_seconds

from quanta.backends.cuda import attention as A
from quanta.backends.cuda import flash_decode as FD

N_CTX = 8192
LAYERS = 20
DEPTHS = (100, 1024, 4096)
SHAPES = [  # name, heads, kv heads, head dim, window
    ("TinyLlama 32/4/64", 32, 4, 64, 0), ("Llama-3.2 32/8/64", 32, 8, 64, 0), ("Qwen2.5 12/2/128", 12, 2, 128, 0),
    ("Gemma-3 4/1/256 w512", 4, 1, 256, 512), ("Gemma-3 4/1/256 global", 4, 1, 256, 0),
    ("SmolLM2 9/3/64", 9, 3, 64, 0),
]
F16, F32 = torch.float16, torch.float32
CONFIGS = {  # name: cache dtype, DecodeScratch keywords: the exact and default modes, then variants
    "exact": (F32, dict(dot="ieee")), "default": (F16, dict(dot="fp16")),
    "ticket": (F16, dict(dot="fp16", poll=False)), "poll": (F16, dict(dot="fp16", poll=True)),
}
START = time.perf_counter()
BUDGET_S = float(os.environ.get("ATTN_BUDGET_S", "150"))
LINES: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LINES.append(msg)


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: int, scale: float, window: int):
    """float64 softmax attention of q (1, H, hd) over keys [lo, pos] of the (hkv, n_ctx, hd) caches."""
    h, hkv = q.shape[1], kc.shape[0]
    lo = max(pos - window + 1, 0) if window else 0
    k = kc[:, lo:pos + 1].double().repeat_interleave(h // hkv, 0)
    v = vc[:, lo:pos + 1].double().repeat_interleave(h // hkv, 0)
    s = torch.einsum("hd,hpd->hp", q[0].double(), k) * scale
    return torch.einsum("hp,hpd->hd", torch.softmax(s, -1), v).reshape(1, -1)


class Case:
    """LAYERS random caches of one shape (in fp32 and fp16), a query, a device position, and a scratch per config."""

    def __init__(self, h: int, hkv: int, hd: int, window: int):
        dev = torch.device("cuda")
        self.h, self.hd, self.window, self.scale = h, hd, window, hd ** -0.5
        f32 = [(torch.randn(hkv, N_CTX, hd, device=dev), torch.randn(hkv, N_CTX, hd, device=dev))
               for _ in range(LAYERS)]
        self.caches = {F32: f32, F16: [(k.half(), v.half()) for k, v in f32]}
        self.q = torch.randn(1, h, hd, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.out = torch.empty(1, h * hd, device=dev)
        self.scratches: dict[str, FD.DecodeScratch] = {}

    def run(self, layer: int, cfg: str) -> torch.Tensor:
        dtype, kw = CONFIGS[cfg]
        if cfg not in self.scratches:
            self.scratches[cfg] = FD.DecodeScratch(self.h, N_CTX, self.hd, torch.device("cuda"), **kw)
        kc, vc = self.caches[dtype][layer]
        return A.attention(self.q, kc, vc, self.pos, scale=self.scale, window=self.window, out=self.out,
                           scratch=self.scratches[cfg])

    def time_us(self, cfg: str) -> float:
        return 1e6 * graph_seconds([lambda i=i: self.run(i, cfg) for i in range(LAYERS)])

    def error(self, depth: int, cfg: str) -> float:
        got = self.run(0, cfg).double()
        want = reference(self.q, *self.caches[CONFIGS[cfg][0]][0], depth, self.scale, self.window)
        return (got - want).abs().max().item()


def main() -> None:
    torch.manual_seed(0)
    say(f"decode attention, µs per call in a CUDA graph of {LAYERS} calls (own caches), n_ctx {N_CTX}; "
        f"BAD: max |out - float64 ref| > 1e-4 (IEEE) or 3e-3 (10-bit dots)")
    cases = {}
    for name, h, hkv, hd, window in SHAPES:
        case = cases[name] = Case(h, hkv, hd, window)
        for depth in DEPTHS:
            case.pos.fill_(depth)
            cells = []
            for cfg in CONFIGS:
                if time.perf_counter() - START > BUDGET_S:
                    break
                err = case.error(depth, cfg)
                bad = " BAD" if err > (1e-4 if CONFIGS[cfg][1]["dot"] == "ieee" else 3e-3) else ""
                cells.append(f"{cfg} {case.time_us(cfg):.2f}{bad}")
            say(f"{name:<24} {depth:>5}  " + "  ".join(cells))


if __name__ == "__main__":
    try:
        main()
    finally:
        say(f"total {time.perf_counter() - START:.0f} s")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "gpu_attn.log"), "w") as f:
                f.write("\n".join(LINES) + "\n")
