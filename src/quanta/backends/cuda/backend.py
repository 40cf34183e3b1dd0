"""The CUDA backend: torch CUDA tensors as arrays, Triton kernels for every op, the decode step as a CUDA graph.

Weights are uploaded once as GGUF bytes and repacked on the device (repack.py); no float copy stays resident.
Intermediates come from named buffers; a one-token forward (decode) uses its own fixed buffers, so the captured
graph's addresses never move. Decode replays the graph after writing the token id and the position into two
device scalars: nothing is allocated and the host reads back only the logits it asks for (or the argmax id).
On a machine without CUDA the backend also runs on ``device="cpu"`` under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import torch

from quanta.backends.base import Array, Backend, KVShape
from quanta.backends.cuda import activation, attention, norm, pdl, rope
from quanta.backends.cuda.embed import embed as _embed
from quanta.backends.cuda.qmatmul import qmatmul
from quanta.backends.cuda.repack import FusedWeight, PackedWeight, fuse, repack
from quanta.backends.cuda.sampling import Argmax
from quanta.errors import QuantaError
from quanta.gguf import TensorInfo


class CUDAKVCache:
    """One K and one V of (n_kv_heads, n_ctx, head_dim) float32 per layer, allocated once."""

    def __init__(self, shape: KVShape, device: torch.device):
        self.shape = shape
        dims = (shape.n_layers, shape.n_kv_heads, shape.n_ctx, shape.head_dim)
        self.k = torch.zeros(dims, dtype=torch.float32, device=device)
        self.v = torch.zeros(dims, dtype=torch.float32, device=device)

    def __len__(self) -> int:
        return self.shape.n_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * 4


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


class _DecodeGraph:
    """The one-token forward captured for one (model, cache): token id and position live in device memory."""

    def __init__(self, model: Any, cache: Any, device: torch.device, token: int, start: int):
        self.ids = torch.full((1,), token, dtype=torch.int32, device=device)
        self.pos = torch.full((1,), start, dtype=torch.int32, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: compiles every kernel; rewrites the same K/V at `start`
            model.forward(self.ids, self.pos, cache, all_logits=False)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.forward(self.ids, self.pos, cache, all_logits=False)

    def run(self, token: int, start: int) -> torch.Tensor:
        self.ids.fill_(token)
        self.pos.fill_(start)
        self.graph.replay()
        return self.logits


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, device: str | torch.device = "cuda", *, exact: bool = False, graphs: bool = True):
        """``exact``: prefill matmuls and attention in IEEE fp32 instead of tf32 tensor cores (decode is fp32
        always)."""
        self.device = torch.device(device)
        self.exact = exact
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise QuantaError("--device cuda needs an NVIDIA GPU with a CUDA build of torch; none was found")
        self.graphs = graphs and self.device.type == "cuda"
        if self.device.type == "cuda":
            threading.Thread(target=_prime_triton, daemon=True).start()
        pdl.enable(self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] >= 9)
        self._buffers: dict[Any, torch.Tensor] = {}
        self._decode_scratch: dict[tuple[int, int, int], attention.DecodeScratch] = {}
        self._argmax: dict[int, Argmax] = {}
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}

    # ---- loading ---------------------------------------------------------------------------------------------
    def load_weight(self, tensor: TensorInfo) -> PackedWeight:
        if len(tensor.shape) != 2:
            raise QuantaError(f"tensor {tensor.name}: expected a matrix, got shape {tuple(tensor.shape)}")
        raw = _host_tensor(tensor.raw).to(self.device)
        return repack(raw, tensor.type, tuple(tensor.shape), tensor.name)

    def fuse(self, weights: list[Any], biases: list[torch.Tensor | None]) -> FusedWeight | None:
        return fuse(weights, biases)

    def load_vector(self, tensor: TensorInfo) -> torch.Tensor:
        if tensor.type == "F32":
            a = tensor.raw.view(np.float32).reshape(tensor.shape)
        else:
            from quanta.quant.reference import dequantize
            a = dequantize(tensor)
        return _host_tensor(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)

    def from_host(self, a: np.ndarray) -> torch.Tensor:
        return _host_tensor(np.ascontiguousarray(a)).to(self.device)

    def to_host(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy()

    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rope_table(inv_freq, n_ctx, self.device)

    def kv_cache(self, shape: KVShape) -> CUDAKVCache:
        self._graphs.clear()
        return CUDAKVCache(shape, self.device)

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        size = int(np.prod(shape))
        if shape and shape[0] == 1:  # decode: fixed storage per (name, shape), the graph reads these addresses
            key: Any = (name, tuple(shape))
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = torch.empty(size, dtype=torch.float32, device=self.device)
            return buf.view(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self._buffers[name] = torch.empty(size, dtype=torch.float32, device=self.device)
        return buf[:size].view(shape)

    # ---- ops -------------------------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int32, device=self.device)

    def matmul(self, x: torch.Tensor, w: PackedWeight, *, out: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        return qmatmul(x, w, out=out, residual=residual, bias=bias, exact=self.exact)

    def matmul_split(self, x: torch.Tensor, w: FusedWeight, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        assert [o.shape[-1] for o in outs] == list(w.widths), ([o.shape for o in outs], w.widths)
        qmatmul(x, w.packed, bias=w.bias, outs=outs, exact=self.exact)
        return outs

    def embed(self, w: PackedWeight, token_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return _embed(w, token_ids, out=out)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps, out=out, residual=residual)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, table: Any, *, neox: bool) -> torch.Tensor:
        return rope.rope(x, positions, table, neox)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, table: Any, *, neox: bool,
                v: torch.Tensor | None = None, cache: Any = None) -> bool:
        rope.rope_qk(q, k, positions, table, neox, v=v, cache=cache)
        return v is not None and cache is not None

    def attention(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: Any,
                  positions: torch.Tensor, *,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        n, n_heads, hd = q.shape
        if out is None:
            out = torch.empty((n, n_heads * hd), dtype=torch.float32, device=self.device)
        k_cache, v_cache = cache
        if k is not None:  # None: rope_qk stored them
            attention.write_kv(k, v, k_cache, v_cache, positions)
        scratch = None
        if n == 1:
            key = (n_heads, k_cache.shape[1], hd)
            scratch = self._decode_scratch.get(key)
            if scratch is None:
                scratch = self._decode_scratch[key] = attention.DecodeScratch(n_heads, k_cache.shape[1], hd,
                                                                              self.device)
        return attention.attention(q, k_cache, v_cache, positions, scale=scale, window=window, softcap=softcap,
                                   out=out, scratch=scratch, exact=self.exact)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return activation.silu_mul(gate, up, out=out)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return activation.gelu_mul(gate, up, out=out)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return activation.add_(a, b)

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        return activation.scale_(x, s)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return activation.softcap_(x, cap)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def argmax(self, x: torch.Tensor) -> int:
        x = x.reshape(-1)
        am = self._argmax.get(x.numel())
        if am is None:
            am = self._argmax[x.numel()] = Argmax(x.numel(), self.device)
        return int(am(x).item())  # the only host read of a decode step

    def last_row(self, x: torch.Tensor) -> torch.Tensor:
        return x[-1:]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- the forward -----------------------------------------------------------------------------------------
    def forward(self, model: Any, token_ids: np.ndarray, start: int, cache: Any, *, all_logits: bool) -> Array:
        # op wrappers installed on the instance (bench's per-op timers) need eager execution
        wrapped = "matmul" in self.__dict__
        if self.graphs and not wrapped and len(token_ids) == 1 and not all_logits:
            key = (id(model), id(cache))
            g = self._graphs.get(key)
            if g is None:
                g = self._graphs[key] = _DecodeGraph(model, cache, self.device, int(token_ids[0]), start)
            return g.run(int(token_ids[0]), start)
        return super().forward(model, token_ids, start, cache, all_logits=all_logits)
