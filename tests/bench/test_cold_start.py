"""`quanta bench --empty-kernel-cache`: each of those cold starts gets a Triton kernel cache of its own, empty, and
its median is reported beside the warm one."""

from __future__ import annotations

import os
from pathlib import Path

from quanta.bench import runner
from quanta.bench.report import format_table


def test_each_empty_cache_start_has_a_new_empty_triton_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)  # (the warm starts keep the caller's cache)
    seen: list[tuple[str | None, list[str]]] = []

    def start(engine, cfg, prompt, env=None):  # the child process's view of its environment
        cache = (env or {}).get("TRITON_CACHE_DIR")
        seen.append((cache, sorted(os.listdir(cache)) if cache else []))
        if cache:
            Path(cache, "compiled.cubin").write_bytes(b"x")  # what a start leaves behind
        return (9.0 if cache else 2.0), 1000

    monkeypatch.setattr(runner, "cold_start", start)
    cfg = runner.BenchConfig(model=tmp_path / "m.gguf", device="cuda", repeats=3, empty_kernel_cache=True)
    out = runner.cold_starts(["quanta"], cfg, [1, 2])
    warm = [c for c, _ in seen if c is None]
    empty = [(c, files) for c, files in seen if c is not None]
    assert len(warm) == 4 and len(empty) == 3  # one untimed warm-up, then the repeats
    assert len({c for c, _ in empty}) == 3 and all(files == [] for _, files in empty)
    assert not any(os.path.exists(c) for c, _ in empty)  # removed afterwards
    assert out["quanta"]["cold_start_s"] == 2.0 and out["quanta"]["cold_start_empty_cache_s"] == 9.0


def test_table_shows_the_empty_cache_start_only_when_measured():
    report = {"model": "m", "device": "cuda", "threads": 1, "prompt_tokens": 8, "decode_tokens": 8, "repeats": 1,
              "bytes_per_token": 1e6, "bandwidth_gb_s": 1.0, "prefill_tok_s": 1.0, "decode_tok_s": 1.0,
              "ttft_ms": 1.0, "decode_ms_per_token": 1.0, "achieved_gb_s": 1.0, "roofline_pct": 1.0,
              "cold_start_s": 2.5, "peak_rss_bytes": 1e9}
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
        report[f"{key}_spread"] = {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "empty kernel cache" not in format_table(report)
    lines = format_table({**report, "cold_start_empty_cache_s": 9.1}).splitlines()
    row = next(x for x in lines if "empty kernel cache" in x)
    assert row.split()[-1] == "9.10"
