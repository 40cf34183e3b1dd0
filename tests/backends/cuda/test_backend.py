"""The whole batched forward on the CUDA backend against the CPU backend's exact mode, on tiny random models of each
architecture whose matrices use many formats: every row's logits of prefills, chunks after a cached prefix and
decode steps of two sequences on scattered blocks, mixed in the same forwards; a sequence's logits whatever else
its batch holds; the KV pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from batches import BLOCK, run_steps
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cpu.backend import CPUBackend
from quanta.models import load_model
from quanta.models.base import QKV

MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q5_1", "ffn_down": "Q4_1", "token_embd": "Q8_0"}
TOKENS = [[1, 5, 7, 9, 11, 2, 20, 21, 22], [4, 8, 15, 3, 16, 17, 30]]
# a prefill of each; then a decode step of the first beside a 2-token chunk of the second; then both decode
STEPS = [[(0, 0, 6), (1, 0, 3)], [(0, 6, 1), (1, 3, 2)], [(0, 7, 1), (1, 5, 1)]]


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
def test_batched_forward_matches_cpu_exact(arch: str, types: dict, tmp_path: Path, device: str,
                                           few_programs: None) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, types=types, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    want, got = (run_steps(be, load_model(gguf.open(path), be, 32), TOKENS, STEPS)
                 for be in (CPUBackend(exact=True), CUDABackend(device, exact=True)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exact", [True, False])
def test_a_sequence_does_not_depend_on_its_batch(exact: bool, tmp_path: Path, device: str,
                                                 few_programs: None) -> None:
    """The first sequence's logits, prefilled and decoded alone, equal its rows of the mixed batches: in exact mode
    up to rounding (the decode attention splits its keys differently for other batch sizes, and a decode token
    beside a prefill chunk takes the prefill kernel); in the default mode up to the int8 activations' error, whose
    roundings those differences can flip."""
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    be = CUDABackend(device, exact=exact)
    model = load_model(gguf.open(path), be, 32)
    alone = run_steps(be, model, TOKENS, [[step[0]] for step in STEPS])
    batched = run_steps(be, model, TOKENS, STEPS)
    for a, b, rows in zip(alone, batched, (6, 1, 1)):
        if exact:
            np.testing.assert_allclose(b[:rows], a, rtol=1e-5, atol=1e-5)
        else:
            assert np.linalg.norm(b[:rows] - a) / np.linalg.norm(a) < 0.03


def test_fusion_groups_follow_formats(tmp_path: Path, device: str) -> None:
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1)
    g = gguf.open(path)
    layer = load_model(g, CUDABackend(device), 32).layers[0]
    assert [p.names for p in layer.qkv] == [("attn_q", "attn_k"), ("attn_v",)]
    assert [p.names for p in layer.gate_up] == [("ffn_gate", "ffn_up")]
    assert not hasattr(layer, "attn_q") and hasattr(layer, "attn_v")  # no second copy of a fused matrix
    alone = [("attn_q",), ("attn_k",), ("attn_v",)]
    cpu = CPUBackend()  # one GEMV job for weights whose q8 activations agree (Q4_K and Q6_K: one scale per 256)
    assert [p.names for p in load_model(g, cpu, 32).layers[0].qkv] == ([QKV] if cpu.isa else alone)
    assert [p.names for p in load_model(g, CPUBackend(exact=True), 32).layers[0].qkv] == alone


def test_long_prompts_dequantize_each_weight_into_one_scratch(tmp_path: Path, device: str, monkeypatch) -> None:
    """Fast mode, a prompt of DEQUANT_MIN_ROWS tokens or more: every layer matmul dequantizes its weight into one
    bf16 scratch (sized at load for the largest matrix) and multiplies it dense; the logits are the fused GEMM's
    (the same bf16 operands, summed in another order)."""
    from quanta.backends.cuda import gemm
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=1,
                            vocab=64)
    n = gemm.DEQUANT_MIN_ROWS + 4
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, 64, n)]
    table = list(range(-(-n // BLOCK)))
    backends, logits = [], []
    for min_rows in (gemm.DEQUANT_MIN_ROWS, 10**9):
        monkeypatch.setattr(gemm, "DEQUANT_MIN_ROWS", min_rows)
        backend = CUDABackend(device, graphs=False)
        model = load_model(gguf.open(path), backend, n)
        logits.append(run_steps(backend, model, [prompt], [[(0, 0, n)]], [table] * 2)[0][-1])
        backends.append(backend)
    dequantized, fused = backends
    assert dequantized._dequant_scratch.numel() == dequantized._dequant_size == 2 * 256 * 256  # gate|up
    assert fused._dequant_scratch is None
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_kv_pool_is_fp16_by_default_and_fp32_when_exact(tmp_path: Path, device: str) -> None:
    """The default mode halves the pool (the itemsize the model runner sizes it by); exact mode keeps float32 like
    the CPU backend. One block more than asked for: the padding rows' of captured decode batches."""
    from quanta.backends.cuda.backend import CUDABackend

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=2)
    g = gguf.open(path)
    for backend, itemsize in ((CUDABackend(device), 2), (CUDABackend(device, exact=True), 4)):
        shape = load_model(g, backend, 48).kv_shape(5, 16)
        pool = backend.kv_cache(shape)
        assert backend.kv_itemsize == itemsize and pool.pad_block == 5
        assert pool.nbytes == 2 * shape.n_layers * shape.n_kv_heads * 6 * 16 * shape.head_dim * itemsize
        assert len(pool) == 2 and pool[1][0].shape == (shape.n_kv_heads, 6 * 16, shape.head_dim)


def test_kv_pool_out_of_gpu_memory_is_a_clear_error(tmp_path: Path, device: str, monkeypatch) -> None:
    """The pool does not fit after all (free memory was read before): torch's out-of-memory error becomes a
    QuantaError that names the pool's size and what to lower."""
    import torch

    from quanta.backends.cuda import backend as cuda_backend
    from quanta.errors import QuantaError

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", types=QK_FUSED, d_model=256, d_ff=256, n_layers=2)
    backend = cuda_backend.CUDABackend(device)
    model = load_model(gguf.open(path), backend, 48)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(cuda_backend, "CUDAKVCache", out_of_memory)
    with pytest.raises(QuantaError, match="KV pool of 48 tokens .*--kv-memory"):
        backend.kv_cache(model.kv_shape(3, 16))


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
