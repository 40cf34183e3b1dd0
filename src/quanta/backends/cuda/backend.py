"""The CUDA backend: torch CUDA tensors as arrays, Triton kernels for every op, decode and prefill as CUDA graphs.

Weights are uploaded once as GGUF bytes and repacked on the device (repack.py); no float copy stays resident.
Intermediates come from named buffers; a one-token forward (decode) uses its own fixed buffers, and a prefill
captured as a graph (padded to a length bucket, graphs.py) uses storage sized for the largest bucket, so the
captured graphs' addresses never move. Decode replays its graph after writing the token id and the position into
two device scalars: nothing is allocated and the host reads back only the logits it asks for (or the argmax id).
On a machine without CUDA the backend also runs on ``device="cpu"`` under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from quanta.backends.base import Array, Backend, KVShape
from quanta.backends.cuda import activation, attention, flash_decode, norm, pdl, rope
from quanta.backends.cuda.copies import ActivationCopies
from quanta.backends.cuda.embed import embed as _embed
from quanta.backends.cuda.gemm import DEQUANT_MAX_WEIGHTS, dequantizes
from quanta.backends.cuda.graphs import (CAPTURE_AT_USE, MAX_GRAPH_PREFILL, DecodeGraph, PrefillGraph,
                                         padded_inputs, prefill_bucket)
from quanta.backends.cuda.q8gemv import Q8_CONFIG
from quanta.backends.cuda.qmatmul import GEMV_CONFIG, gemv_launch, qmatmul
from quanta.backends.cuda.repack import FusedWeight, PackedWeight, fuse, repack
from quanta.backends.cuda.sampling import Argmax
from quanta.errors import NoCUDAError, QuantaError
from quanta.gguf import TensorInfo


class CUDAKVCache:
    """One K and one V of (n_kv_heads, n_ctx, head_dim) per layer (float32, or float16 in the default mode),
    allocated once."""

    def __init__(self, shape: KVShape, device: torch.device, dtype: torch.dtype = torch.float32):
        self.shape = shape
        dims = (shape.n_layers, shape.n_kv_heads, shape.n_ctx, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.shape.n_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def _prime_triton() -> None:
    """Triton hashes its own sources before its first kernel-cache lookup in a process (~0.35 s on the H200
    machine): done in a thread while the weights upload, it is off the path to the first token."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # an internal of Triton: a version without it just pays the cost at the first launch
        pass


def _host_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # GGUF tensors are read-only mmap views; torch only reads them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda", *, exact: bool = False, graphs: bool = True):
        """``exact``: every matmul and attention in IEEE fp32, KV cache in fp32. Otherwise prefill matmuls run on
        bf16 tensor cores, decode matmuls on int8 activations (q8gemv.py; ``QUANTA_Q8=0``: float activations),
        the KV cache is fp16 and attention multiplies on tensor cores (flash_decode.py's ``_dot``)."""
        self.device = torch.device(device)
        self.exact = exact
        self.q8 = not exact and os.environ.get("QUANTA_Q8", "1") != "0"
        self.kv_dtype = torch.float32 if exact else torch.float16
        self.kv_itemsize = 4 if exact else 2
        self.decode_dot = "ieee" if exact else "fp16"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise NoCUDAError()
        self.graphs = graphs and self.device.type == "cuda"
        self._primer: threading.Thread | None = None
        if self.device.type == "cuda":
            self._primer = threading.Thread(target=_prime_triton, daemon=True)
            self._primer.start()
        pdl.enable(self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] >= 9)
        self._buffers: dict[Any, torch.Tensor] = {}
        self._decode_scratch: dict[tuple[int, int, int, str], flash_decode.DecodeScratch] = {}
        self._argmax: dict[int, Argmax] = {}
        # int8 (decode) and bf16 word-order (prefill) copies of activations, written by their producers
        self._copies = ActivationCopies(self.device, q8=self.q8, words=not exact, buffer=self.buffer)
        # decode graphs per (model, cache), prefill graphs per (model, cache, bucket); a new cache drops them all
        self._graphs: dict[tuple[int, ...], DecodeGraph | PrefillGraph] = {}
        self._prefill_uses: dict[tuple[int, int, int], int] = {}  # prefills per (model, cache, bucket)
        self._prefill_rows = 0  # > 0 while a graph prefill's forward runs: the rows its buffers are sized for
        self._prefill_buffers: dict[str, torch.Tensor] = {}
        self._prefill_pool: Any = None  # one graph memory pool and one capture stream for every prefill graph
        self._capture_stream: torch.cuda.Stream | None = None
        # the bf16 scratch prefill GEMMs dequantize a weight into (gemm.dequantizes), made at the first such GEMM
        # for the largest layer matrix loaded (larger ones that may use it grow it)
        self._dequant_scratch: torch.Tensor | None = None
        self._dequant_size = 0

    # ---- loading ---------------------------------------------------------------------------------------------
    def load_weight(self, tensor: TensorInfo) -> PackedWeight:
        if len(tensor.shape) != 2:
            raise QuantaError(f"tensor {tensor.name}: expected a matrix, got shape {tuple(tensor.shape)}")
        try:
            raw = _host_tensor(tensor.raw).to(self.device)
            w = repack(raw, tensor.type, tuple(tensor.shape), tensor.name)
        except torch.OutOfMemoryError:
            raise self._weights_too_large(tensor) from None
        self._copies.count_weight(w.kind)
        if tensor.name.startswith("blk."):  # a layer's matrix (an lm head reaches a GEMM only for all logits)
            self._note_dequant_size(w)
        return w

    def _weights_too_large(self, tensor: TensorInfo) -> QuantaError:
        free = self.free_memory() or 0
        return QuantaError(f"the model's weights do not fit in the GPU's memory: {tensor.name} "
                           f"({tensor.raw.nbytes / 2**20:.0f} MiB) did not, with {free / 2**30:.1f} GiB left free; "
                           f"use a smaller model or quantization, or a GPU with more memory")

    def fuse(self, weights: list[Any], biases: list[torch.Tensor | None]) -> FusedWeight | None:
        fused = fuse(weights, biases)
        if fused is not None:
            self._note_dequant_size(fused.packed)
        return fused

    def _note_dequant_size(self, w: PackedWeight) -> None:
        if w.kind != "dense" and w.n * w.k <= DEQUANT_MAX_WEIGHTS:
            self._dequant_size = max(self._dequant_size, w.n * w.k)

    def _scratch_for(self, m: int, w: PackedWeight) -> torch.Tensor | None:
        """The bf16 scratch a GEMM of ``m`` rows dequantizes ``w`` into, or None: no dequantizing (gemm.py's
        ``dequantizes``), or no memory for the scratch (the fused GEMM then runs)."""
        if not dequantizes(m, w, self.exact):
            return None
        if self._dequant_scratch is None or self._dequant_scratch.numel() < w.n * w.k:
            # made by an eager forward (a prompt length's first use runs eagerly, before its graph is captured)
            assert self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
            if self._dequant_scratch is not None:  # a larger model's: graphs captured before read the old one
                self._drop_prefill_graphs()
            self._dequant_scratch = None
            try:
                self._dequant_scratch = torch.empty(max(self._dequant_size, w.n * w.k), dtype=torch.bfloat16,
                                                    device=self.device)
            except torch.OutOfMemoryError:
                return None
        return self._dequant_scratch

    def load_vector(self, tensor: TensorInfo) -> torch.Tensor:
        if tensor.type == "F32":
            a = tensor.raw.view(np.float32).reshape(tensor.shape)
        else:
            from quanta.quant.reference import dequantize
            a = dequantize(tensor)
        try:
            return _host_tensor(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)
        except torch.OutOfMemoryError:
            raise self._weights_too_large(tensor) from None

    def from_host(self, a: np.ndarray) -> torch.Tensor:
        return _host_tensor(np.ascontiguousarray(a)).to(self.device)

    def to_host(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy()

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rope_table(inv_freq, n_ctx, self.device)

    def kv_cache(self, shape: KVShape) -> CUDAKVCache:
        self._graphs.clear()
        self._prefill_uses.clear()
        try:
            return CUDAKVCache(shape, self.device, self.kv_dtype)
        except torch.OutOfMemoryError:
            need = shape.nbytes(self.kv_itemsize)
            raise QuantaError(f"the KV cache for n_ctx {shape.n_ctx:,} ({need / 2**30:.1f} GiB) does not fit in "
                              f"the GPU's free memory next to the weights; lower n_ctx (--n-ctx)") from None

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        size = int(np.prod(shape))
        if shape and shape[0] == 1:  # decode: fixed storage per (name, shape), the graph reads these addresses
            key: Any = (name, tuple(shape))
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = torch.empty(size, dtype=torch.float32, device=self.device)
            return buf.view(shape)
        if self._prefill_rows:  # a graph prefill: storage for its largest bucket, shared by all prefill graphs
            need = size // shape[0] * self._prefill_rows
            buf = self._prefill_buffers.get(name)
            if buf is None or buf.numel() < need:
                if buf is not None:  # a wider model's warm-up: the captured graphs read the old storage
                    self._drop_prefill_graphs()
                buf = self._prefill_buffers[name] = torch.empty(need, dtype=torch.float32, device=self.device)
            return buf[:size].view(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self._buffers[name] = torch.empty(size, dtype=torch.float32, device=self.device)
        return buf[:size].view(shape)

    # ---- ops -------------------------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int32, device=self.device)

    def matmul(self, x: torch.Tensor, w: PackedWeight, *, out: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        xq, xw = self._copies.matmul_input(x, [out] if out is not None else [], w.kind)
        return qmatmul(x, w, out=out, residual=residual, bias=bias, exact=self.exact, xq=xq, xw=xw,
                       scratch=self._scratch_for(x.shape[0], w))

    def matmul_split(self, x: torch.Tensor, w: FusedWeight, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        assert [o.shape[-1] for o in outs] == list(w.widths), ([o.shape for o in outs], w.widths)
        xq, xw = self._copies.matmul_input(x, outs, w.packed.kind)
        qmatmul(x, w.packed, bias=w.bias, outs=outs, exact=self.exact, xq=xq, xw=xw,
                scratch=self._scratch_for(x.shape[0], w.packed))
        return outs

    def embed(self, w: PackedWeight, token_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        self._copies.produce(None)
        return _embed(w, token_ids, out=out)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(x)
        q8, words = self._copies.produce(out)
        return norm.rms_norm(x, weight, eps, out=out, residual=residual, q8=q8, words=words)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, table: Any, *, neox: bool) -> torch.Tensor:
        self._copies.produce(None)
        return rope.rope(x, positions, table, neox)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: Any, *, neox: bool,
                v: torch.Tensor | None = None, cache: Any = None) -> bool:
        self._copies.produce(None)
        rope.rope_qk(q, k, positions, table, neox, v=v, cache=cache)
        return v is not None and cache is not None

    def qkv_rope(self, x: torch.Tensor, groups: list[Any], outs: dict[str, torch.Tensor], positions: torch.Tensor,
                 table: Any, *, neox: bool, cache: Any) -> bool:
        """Decode: each Q/K/V GEMV rotates its rows and stores keys and values in its epilogue (rope.py's
        ``rope_store``): the rope_qk launch goes. Needs full-width rope and quantized weights whose GEMV tile has an
        even row count (rotated pairs in one program)."""
        q = outs["attn_q"]
        nq, nk = q.shape[1], outs["attn_k"].shape[1]
        if x.shape[0] != 1 or cache is None or 2 * table[0].shape[1] != cache[0].shape[2]:
            return False
        tiles = GEMV_CONFIG if self._copies.q8_copy(x) is None else Q8_CONFIG
        parts = []
        for g in groups:
            w, bias = (g.weight.packed, g.weight.bias) if g.fused else (g.weight, g.bias)
            if w.kind == "dense" or gemv_launch(tiles, w)[0] % 2:
                return False
            parts.append((w, bias, {"attn_q": 0, "attn_k": nq, "attn_v": nq + nk}[g.names[0]]))
        xq, _ = self._copies.matmul_input(x, [q], parts[0][0].kind)
        for w, bias, row0 in parts:
            qmatmul(x, w, bias=bias, exact=self.exact, xq=xq,
                    rope=rope.RopeStore(q, cache, positions, table, neox, row0, nq, nk))
        return True

    def attention(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: Any,
                  positions: torch.Tensor, *,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        n, n_heads, hd = q.shape
        if out is None:
            out = torch.empty((n, n_heads * hd), dtype=torch.float32, device=self.device)
        q8, words = self._copies.produce(out, q8=n == 1 and flash_decode.writes_q8(hd), words=hd % 32 == 0)
        k_cache, v_cache = cache
        if k is not None:  # None: rope_qk stored them
            attention.write_kv(k, v, k_cache, v_cache, positions)
        scratch = None
        if n == 1:
            key = (n_heads, k_cache.shape[1], hd, self.decode_dot)
            scratch = self._decode_scratch.get(key)
            if scratch is None:
                scratch = self._decode_scratch[key] = flash_decode.DecodeScratch(n_heads, k_cache.shape[1], hd,
                                                                              self.device, dot=self.decode_dot)
        return attention.attention(q, k_cache, v_cache, positions, scale=scale, window=window, softcap=softcap,
                                   out=out, scratch=scratch, exact=self.exact, q8=q8, words=words)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if out is not None else torch.empty_like(gate)
        return activation.silu_mul(gate, up, out, *self._copies.produce(out))

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if out is not None else torch.empty_like(gate)
        return activation.gelu_mul(gate, up, out, *self._copies.produce(out))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self._copies.produce(None)
        return activation.add_(a, b)

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        self._copies.produce(None)
        return activation.scale_(x, s)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        self._copies.produce(None)
        return activation.softcap_(x, cap)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def argmax(self, x: torch.Tensor) -> int:
        return int(self._argmax_of(x.numel())(x.reshape(-1)).item())  # a decode step's one host read

    def _argmax_of(self, n: int) -> Argmax:
        am = self._argmax.get(n)
        if am is None:
            am = self._argmax[n] = Argmax(n, self.device)
        return am

    def greedy_decode(self, model: Any, cache: Any, token: int, start: int, steps: int) -> Iterator[int]:
        """Chained decode graphs (``DecodeGraph.greedy``), or the base loop where graphs are off."""
        if not self.graphs or "matmul" in self.__dict__:
            yield from super().greedy_decode(model, cache, token, start, steps)
            return
        yield from self._decode_graph(model, cache, token, start).greedy(self._argmax_of(model.n_vocab), token,
                                                                          start, steps)

    def last_row(self, x: torch.Tensor) -> torch.Tensor:
        return x[-1:]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- the forward -----------------------------------------------------------------------------------------
    def forward(self, model: Any, token_ids: np.ndarray, start: int, cache: Any, *, all_logits: bool) -> Array:
        self._join_primer()
        # op wrappers installed on the instance (bench's per-op timers) need eager execution
        wrapped = "matmul" in self.__dict__
        if self.graphs and not wrapped and not all_logits:
            if len(token_ids) == 1:
                return self._decode_graph(model, cache, int(token_ids[0]), start).run(int(token_ids[0]), start)
            n_ctx = min(model.n_ctx, cache.shape.n_ctx)
            rows = prefill_bucket(len(token_ids), start, n_ctx)
            if rows is not None:
                key = (id(model), id(cache), rows)
                self._prefill_uses[key] = self._prefill_uses.get(key, 0) + 1
            if rows is not None and self._prefill_uses[key] >= CAPTURE_AT_USE:
                return self._prefill_graph(model, cache, token_ids, start, rows, min(MAX_GRAPH_PREFILL, n_ctx))
        return super().forward(model, token_ids, start, cache, all_logits=all_logits)

    def _join_primer(self) -> None:
        if self._primer is not None:  # the first launch would hash Triton's sources again while the thread does
            self._primer.join()
            self._primer = None

    def _decode_graph(self, model: Any, cache: Any, token: int, start: int) -> DecodeGraph:
        self._join_primer()
        g = self._graphs.get((id(model), id(cache)))
        if g is None:
            g = self._graphs[(id(model), id(cache))] = DecodeGraph(model, cache, self.device, token, start)
        assert isinstance(g, DecodeGraph)
        return g

    def _prefill_graph(self, model: Any, cache: Any, token_ids: np.ndarray, start: int, rows: int,
                       capacity: int) -> torch.Tensor:
        """Replay (captured at its first use) the graph of ``rows`` padded rows; buffers sized for ``capacity``."""
        inputs = padded_inputs(token_ids, start, rows)
        key = (id(model), id(cache), rows)
        g = self._graphs.get(key)
        if g is None:
            if not any(isinstance(h, PrefillGraph) for h in self._graphs.values()):
                # a new pool: the old one (if any) is released with its last graph, its id not safely reusable
                self._prefill_pool = torch.cuda.graph_pool_handle()
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            g = self._graphs[key] = PrefillGraph(
                lambda ids, positions: self._padded_forward(model, cache, ids, positions, capacity), inputs,
                self.device, self._prefill_pool, self._capture_stream)
        return g.run(inputs)

    def _padded_forward(self, model: Any, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                        capacity: int) -> torch.Tensor:
        """The last row's logits of ``model.forward`` on padded rows (graphs.padded_inputs), its intermediates in
        the prefill storage sized for ``capacity`` rows: the forward a prefill graph captures."""
        self._prefill_rows = capacity
        try:
            return model.forward(ids, positions, cache, all_logits=False)
        finally:
            self._prefill_rows = 0

    def _drop_prefill_graphs(self) -> None:
        self.synchronize()  # a replay may still read the storage about to be replaced
        for key in [k for k, g in self._graphs.items() if isinstance(g, PrefillGraph)]:
            del self._graphs[key]
