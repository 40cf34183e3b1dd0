"""`quanta bench` end to end on the real SmolLM2 (tiny sizes), against llama.cpp side by side."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import gguf as gguf_py
import pytest

from quanta.bench.engines import LlamaCppEngine
from quanta.bench.profile import kernel_totals, op_timers
from quanta.bench.report import format_table
from quanta.bench.roofline import CPUReadProbe, kv_bytes_per_token
from quanta.cli.main import main
from quanta.errors import QuantaError


@pytest.fixture(scope="module")
def report(smollm2_path, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    out = tmp_path_factory.mktemp("bench")
    status = main(["bench", "-m", str(smollm2_path), "-p", "32", "-n", "8", "--repeats", "2", "--threads", "2",
                   "--depth", "48", "--vs", "llama.cpp", "--json", str(out / "r.json"), "--plot", str(out / "r.png")])
    assert status == 0
    return json.loads((out / "r.json").read_text()), out / "r.png"


def test_report_has_the_documented_keys_for_both_engines(report):
    r, _ = report
    keys = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "bytes_per_token", "roofline_pct")
    for engine in (r, r["baseline"]):
        for k in keys:
            assert engine[k] > 0, k
        assert engine["depth_decode_tok_s"] > 0
        assert engine["cold_start_s"] > 0 and engine["peak_rss_bytes"] > 0
    assert r["decode_ratio"] == pytest.approx(r["decode_tok_s"] / r["baseline"]["decode_tok_s"])
    assert r["prefill_ratio"] == pytest.approx(r["prefill_tok_s"] / r["baseline"]["prefill_tok_s"])
    assert r["baseline"]["decode_ratio"] == r["decode_ratio"]


def test_table_header_names_the_device_and_threads(report):
    r, _ = report
    assert format_table(r).splitlines()[0].startswith(f"model {r['model']} · cpu · 2 threads · p=32 n=8")


def test_spread_brackets_the_median(report):
    r, _ = report
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "cold_start_s", "bandwidth_gb_s"):
        s = r[f"{key}_spread"]
        assert s["min"] <= s["median"] == r[key] <= s["max"]


def test_bytes_per_token_counts_weights_and_kv_as_gguf_py_reads_them(report, smollm2_path):
    r, _ = report
    reader = gguf_py.GGUFReader(smollm2_path)
    names = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in names
    weights = sum(b for n, b in names.items() if tied or n != "token_embd.weight")
    kv = kv_bytes_per_token(30, 3, 64, r["prompt_tokens"] + r["decode_tokens"] // 2, itemsize=2)  # f16 pool
    assert r["bytes_per_token"] == weights + kv
    roof = r["bandwidth_gb_s"] * 1e9 / r["bytes_per_token"]
    assert r["roofline_pct"] == pytest.approx(100 * r["decode_tok_s"] / roof)


def test_breakdown_covers_matmul_by_type_and_other(report):
    r, _ = report
    assert r["breakdown_of"] == "ops, host time"
    decode = r["breakdown"]["decode"]
    assert {"matmul Q4_1", "matmul Q8_0", "attention", "rms_norm"} <= set(decode)
    assert "other (python, sampling)" in decode
    assert all(v >= 0 for v in decode.values())


def test_plot_is_a_png(report):
    _, png = report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bandwidth_probe_is_plausible():
    bw = CPUReadProbe(1, size_mb=64).sample(repeats=2)
    assert 1e9 < bw < 1e12


def test_op_timers_restore_the_backend_methods():
    class Backend:
        def matmul(self, x, w):
            return x

    b = Backend()
    with op_timers(b) as totals:
        b.matmul(1, type("W", (), {"type": "Q4_0"})())
    assert "matmul Q4_0" in totals and "matmul" not in b.__dict__
    assert b.matmul(2, None) == 2


@pytest.mark.parametrize("argv", [["-p", "0"], ["--depth", "-1"], ["-m", "no-such-model"]])
def test_bad_arguments_are_one_line_errors(argv, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quanta: error:") and "Traceback" not in err


def test_vs_llama_cpp_without_llama_cpp_python_says_in_one_line_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `make run` leaves: the import fails
    with pytest.raises(QuantaError) as e:
        LlamaCppEngine("model.gguf", threads=1, n_ctx=16)
    assert "make bench-deps" in str(e.value) and "\n" not in str(e.value)


def test_op_timers_count_composite_ops_once():
    class Backend:
        def rope(self, x):
            time.sleep(0.01)

        def rope_qk(self, q, k):
            self.rope(q)
            self.rope(k)

    b = Backend()
    with op_timers(b) as totals:
        b.rope_qk(1, 2)
    assert set(totals) == {"rope_qk"} and totals["rope_qk"] >= 0.02


def test_kernel_totals_sum_device_time_by_kernel_name():
    """The GPU breakdown's grouping (the profiler itself runs only on a GPU: tests/backends/cuda/test_bench_cuda.py):
    µs summed per name, Triton's ``_x_kernel`` named ``x``, torch's by the op inside, host-only events (no device
    time) dropped."""
    ev = [SimpleNamespace(key="_gemv_q8_kernel", device_time_total=300.0),
          SimpleNamespace(key="_rms_norm_kernel", device_time_total=50.0),
          SimpleNamespace(key="_gemv_q8_kernel", device_time_total=200.0),
          SimpleNamespace(key="cudaLaunchKernel", device_time_total=0.0),
          SimpleNamespace(key="Memcpy HtoD (Pageable -> Device)", device_time_total=2.0),
          SimpleNamespace(key=TORCH_CAST, device_time_total=7.0)]
    want = {"gemv_q8": 5e-4, "rms_norm": 5e-5, "Memcpy HtoD (Pageable -> Device)": 2e-6, "torch bfloat16_copy": 7e-6}
    assert kernel_totals(ev) == pytest.approx(want)


# a name torch's profiler gave one of its cast kernels on the H200 (torch 2.11)
TORCH_CAST = ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda("
              "at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::"
              "bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul>)")
