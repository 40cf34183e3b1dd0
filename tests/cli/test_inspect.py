"""`quanta inspect --check`: every tensor scanned for NaN/inf, counted as gguf-py's dequantizer counts them."""

from __future__ import annotations

import json
import tracemalloc

import gguf
import numpy as np
import pytest

from quanta.cli import main as cli
from quanta.cli.inspect import nonfinite_counts
from quanta.gguf import TensorToWrite, open_gguf, write_gguf
from quanta.quant import quantize


@pytest.fixture
def quanta(capsys):
    def run(*argv: str) -> tuple[int, str, str]:
        status = cli.main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _tensors(poisoned: bool) -> list[TensorToWrite]:
    rng = np.random.default_rng(0)
    norm = np.ones(256, np.float32)
    f16 = rng.standard_normal((4, 256)).astype(np.float16)
    q8 = quantize(rng.standard_normal((4, 256)).astype(np.float32), "Q8_0").reshape(-1).copy()
    if poisoned:
        norm[[3, 7]] = np.nan
        f16[1, 5], f16[2, 9], f16[3, 0] = np.inf, -np.inf, np.nan
        q8[34 * 5 : 34 * 5 + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # block 5's scale: 32 NaN
    return [TensorToWrite("norm", "F32", (256,), norm), TensorToWrite("f16", "F16", (4, 256), f16),
            TensorToWrite("q8", "Q8_0", (4, 256), q8),
            TensorToWrite("q4k", "Q4_K", (2, 256), quantize(rng.standard_normal((2, 256)).astype(np.float32), "Q4_K"))]


def _write(path, poisoned: bool):
    write_gguf(path, {"general.architecture": "llama"}, _tensors(poisoned))
    return path


def _gguf_py_counts(path) -> dict[str, tuple[int, int]]:
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if np.isnan(w).any() or np.isinf(w).any():
            out[t.name] = (int(np.isnan(w).sum()), int(np.isinf(w).sum()))
    return out


def test_check_names_the_tensors_holding_nan_or_inf(quanta, tmp_path):
    path = _write(tmp_path / "bad.gguf", poisoned=True)
    expected = _gguf_py_counts(path)
    assert set(expected) == {"norm", "f16", "q8"} and expected["q8"] == (32, 0)
    status, out, _ = quanta("inspect", str(path), "--check", "--json")
    assert status == 1
    found = {r["name"]: (r["nan"], r["inf"]) for r in json.loads(out)["nonfinite"]}
    assert found == expected
    status, out, _ = quanta("inspect", str(path), "--check")
    assert status == 1 and "check: norm (F32) holds 2 NaN and 0 inf weights" in out
    assert "check: 3 tensor(s) with non-finite weights" in out


def test_check_of_a_clean_file(quanta, tmp_path):
    path = _write(tmp_path / "ok.gguf", poisoned=False)
    assert _gguf_py_counts(path) == {}
    status, out, _ = quanta("inspect", str(path), "--check")
    assert status == 0 and "check: every weight is finite" in out
    status, out, _ = quanta("inspect", str(path))  # no --check: no scan
    assert status == 0 and "check:" not in out


def test_the_scan_never_holds_a_whole_fp32_copy(smollm2_path):
    with open_gguf(smollm2_path) as f:
        embd = f.tensors["token_embd.weight"]  # 28M weights: 113 MB as fp32
        tracemalloc.start()
        try:
            assert nonfinite_counts(embd) == (0, 0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < embd.n_elements * 4 // 4, peak  # measured: ~17 MB
