"""`quanta bench --device cuda` end to end on a small random TinyLlama-shaped model (GPU only: its breakdown is
torch's profiler record of CUDA kernels)."""

from __future__ import annotations

import pytest
import torch

from quanta.bench.report import format_table
from quanta.bench.runner import BenchConfig, run_bench
from quanta.synth import get_preset, synthesize


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels")
def test_bench_reports_kernels_and_steady_figures(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    synthesize(get_preset("tinyllama-1.1b").with_overrides(layers=2, vocab=2048), path, "Q4_K_M", progress=False)
    r = run_bench(BenchConfig(model=path, device="cuda", prompt_tokens=64, decode_tokens=16, depth=96, repeats=3,
                              cold_start=False), progress=False)
    assert r["breakdown_of"].startswith("CUDA kernels")
    head = format_table(r).splitlines()[0]
    assert f"cuda ({torch.cuda.get_device_name()})" in head and "threads" not in head, head
    decode, prefill = r["breakdown"]["decode"], r["breakdown"]["prefill"]
    # the default mode's decode: int8 GEMVs, the split-KV attention, the norms; prefill: the GEMM
    assert {"gemv_q8", "decode_attention", "rms_norm"} <= set(decode), decode
    assert {"gemm", "prefill_attention", "rms_norm"} <= set(prefill), prefill
    assert all(ms > 0 for ms in (*decode.values(), *prefill.values()))
    assert all(len(name) <= 40 for name in (*decode, *prefill))  # torch's C++ template names shortened
    assert "other (python, sampling)" not in decode
    # the warm-up ran the prompt twice, so no repeat pays for compiling or capturing its prefill graph
    assert r["prefill_tok_s_spread"]["min"] > 0.5 * r["prefill_tok_s"], r["prefill_tok_s_spread"]
    assert r["ttft_ms_spread"]["max"] < 2 * r["ttft_ms"], r["ttft_ms_spread"]
