"""The whole forward on the CUDA backend against the CPU backend's exact mode, on tiny random models of each
architecture whose matrices use many formats: prefill logits, greedy continuations, and (on a GPU) CUDA-graph
decode against eager decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cpu.backend import CPUBackend
from quanta.models import load_model

MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q5_1", "ffn_down": "Q4_1", "token_embd": "Q8_0"}


def _run(backend, path: Path, prompt: list[int], n_new: int):
    g = gguf.open(path)
    model = load_model(g, backend, 32)
    cache = backend.kv_cache(model.kv_shape())
    logits = backend.forward(model, np.asarray(prompt, np.int32), 0, cache, all_logits=True)
    prefill = backend.to_host(logits).copy()
    tok, pos, out = backend.argmax(backend.last_row(logits)), len(prompt), []
    for _ in range(n_new):
        out.append(tok)
        tok = backend.argmax(backend.forward(model, np.asarray([tok], np.int32), pos, cache, all_logits=False)[0])
        pos += 1
    return prefill, out


# MIXED: no two matrices share a format (nothing fused); QK_FUSED: q|k fused with v (Q6_K) alone, as in Q4_K_M
# files, and gate|up fused; qwen2 and gemma3 (all Q8_0): q|k|v (with biases) and gate|up fused
QK_FUSED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
            "ffn_down": "Q6_K"}
# 2- and 3-bit codes (stored as 4-bit codes): q|k and gate|up fused, the embedding in Q3_K (attn_output's 64-wide
# rows cannot hold 256-weight blocks)
LOW_BITS = {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "ffn_gate": "Q3_K", "ffn_up": "Q3_K",
            "ffn_down": "Q2_K", "token_embd": "Q3_K"}


@pytest.mark.slow
@pytest.mark.parametrize("arch,types", [("llama", MIXED), ("llama", QK_FUSED), ("llama", LOW_BITS), ("qwen2", {}),
                                        ("gemma3", {"token_embd": "F16"})])
def test_forward_matches_cpu_exact(arch: str, types: dict, tmp_path: Path, device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    prompt = [1, 5, 7, 9, 11, 2]
    want_logits, want_tokens = _run(CPUBackend(exact=True), path, prompt, 3)
    got_logits, got_tokens = _run(CUDABackend(device, exact=True), path, prompt, 3)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="CUDA graphs need a GPU")
def test_graph_decode_equals_eager(tmp_path: Path) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=MIXED, d_model=256, d_ff=256)
    _, eager = _run(CUDABackend("cuda", graphs=False), path, [3, 4, 5], 8)
    _, graph = _run(CUDABackend("cuda"), path, [3, 4, 5], 8)
    assert graph == eager


def test_fusion_groups_follow_formats(tmp_path: Path, device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1)
    g = gguf.open(path)
    layer = load_model(g, CUDABackend(device), 32).layers[0]
    assert [p.names for p in layer.qkv] == [("attn_q", "attn_k"), ("attn_v",)]
    assert [p.names for p in layer.gate_up] == [("ffn_gate", "ffn_up")]
    assert not hasattr(layer, "attn_q") and hasattr(layer, "attn_v")  # no second copy of a fused matrix
    cpu_layer = load_model(g, CPUBackend(), 32).layers[0]
    assert [p.names for p in cpu_layer.qkv] == [("attn_q",), ("attn_k",), ("attn_v",)]


def test_long_prompts_dequantize_each_weight_into_one_scratch(tmp_path: Path, device: str, monkeypatch) -> None:
    """Fast mode, a prompt of DEQUANT_MIN_ROWS tokens or more: every layer matmul dequantizes its weight into one
    bf16 scratch (sized at load for the largest matrix) and multiplies it dense; the logits are the fused GEMM's
    (the same bf16 operands, summed in another order)."""
    from quanta.backends.cuda import gemm
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, 64, gemm.DEQUANT_MIN_ROWS + 4)]
    backends, logits = [], []
    for min_rows in (gemm.DEQUANT_MIN_ROWS, 10**9):
        monkeypatch.setattr(gemm, "DEQUANT_MIN_ROWS", min_rows)
        backend = CUDABackend(device, graphs=False)
        model = load_model(gguf.open(path), backend, len(prompt))
        cache = backend.kv_cache(model.kv_shape())
        logits.append(backend.to_host(backend.forward(model, np.asarray(prompt, np.int32), 0, cache,
                                                      all_logits=False)).copy())
        backends.append(backend)
    dequantized, fused = backends
    assert dequantized._dequant_scratch.numel() == dequantized._dequant_size == 2 * 256 * 256  # gate|up
    assert fused._dequant_scratch is None
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_kv_cache_is_fp16_by_default_and_fp32_when_exact(tmp_path: Path, device: str) -> None:
    """The default mode halves the KV cache (the engine's itemsize is what `quanta bench` counts in bytes per
    token); exact mode keeps float32 like the CPU backend."""
    from quanta.backends.cuda.backend import CUDABackend
    from quanta.engine import KVCache

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=2)
    g = gguf.open(path)
    for backend, itemsize in ((CUDABackend(device), 2), (CUDABackend(device, exact=True), 4), (CPUBackend(), 4)):
        kv = KVCache(backend, load_model(g, backend, 48).kv_shape())
        assert kv.itemsize == itemsize == backend.kv_itemsize  # what the context-size check counts
        s = kv.shape
        assert kv.arena.nbytes == 2 * s.n_layers * s.n_kv_heads * 48 * s.head_dim * itemsize


def test_kv_cache_out_of_gpu_memory_is_a_clear_error(tmp_path: Path, device: str, monkeypatch) -> None:
    """The context check passed (free memory is read before the weights upload) but the cache still does not fit:
    torch's out-of-memory error becomes a QuantaError that names n_ctx."""
    import torch

    from quanta.backends.cuda import backend as cuda_backend
    from quanta.errors import QuantaError

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=2)
    backend = cuda_backend.CUDABackend(device)
    model = load_model(gguf.open(path), backend, 48)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(cuda_backend, "CUDAKVCache", out_of_memory)
    with pytest.raises(QuantaError, match="KV cache for n_ctx 48 .* lower n_ctx"):
        backend.kv_cache(model.kv_shape())


@pytest.mark.parametrize("where", ["repack", "vector"])
def test_weights_out_of_gpu_memory_are_a_clear_error(where: str, tmp_path: Path, device: str, monkeypatch) -> None:
    """A matrix (or a norm vector) that does not fit in the GPU's memory: a QuantaError that names the tensor."""
    import torch

    from quanta.backends.cuda import backend as cuda_backend
    from quanta.errors import QuantaError

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", n_layers=1)
    backend = cuda_backend.CUDABackend(device)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    if where == "repack":
        monkeypatch.setattr(cuda_backend, "repack", out_of_memory)
        name = "token_embd.weight|output.weight|blk.0"
    else:
        host_tensor = cuda_backend._host_tensor  # matrices arrive as GGUF bytes, vectors as float32
        monkeypatch.setattr(cuda_backend, "_host_tensor", lambda a: host_tensor(a) if a.dtype != np.float32
                            else type("Host", (), {"to": out_of_memory})())
        name = "norm.weight"
    with pytest.raises(QuantaError, match=f"weights do not fit in the GPU's memory: .*({name}).* MiB"):
        load_model(gguf.open(path), backend, 16)
