"""The CUDA backend: torch CUDA tensors as arrays, Triton kernels for every op, forwards captured as CUDA graphs.

Weights are uploaded once as GGUF bytes and repacked on the device (repack.py); no float copy stays resident.
Intermediates come from named buffers that grow to the largest batch; a forward recorded by :meth:`capture`
(graphs.py) gets buffers of its own, so no growth ever moves what a graph reads. The KV pool has one block past
the engine's (``CUDAKVCache.pad_block``) for the padding rows of captured decode batches. On a machine without
CUDA the backend also runs on ``device="cpu"`` under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from quanta.backends.base import AttentionMetadata, Backend, KVShape, SamplingRows
from quanta.backends.cuda import activation, attention, draw, flash_decode, kv_q8, norm, rope
from quanta.backends.cuda.compile_ahead import compiles_ahead, dry_run_compiling
from quanta.backends.cuda.copies import ActivationCopies
from quanta.backends.cuda.embed import embed as _embed
from quanta.backends.cuda.gemm import DEQUANT_MAX_WEIGHTS, dequantizes
from quanta.backends.cuda.graphs import GraphRecorder
from quanta.backends.cuda.qmatmul import INT8_MAX_ROWS, qmatmul, rope_fits
from quanta.backends.cuda.repack import FusedWeight, PackedWeight, fuse, repack
from quanta.backends.cuda.sampling import ArgmaxRows, feed
from quanta.errors import NoCUDAError, QuantaError
from quanta.gguf import TensorInfo

_META_FIELDS = ("positions", "slots", "token_seq", "seq_lens", "query_starts")


class CUDAKVCache:
    """One K and one V of (n_kv_heads, n_slots, head_dim) per layer (float32, float16 in the default mode, or
    int8 codes with scales: kv_q8.py), allocated once: the shape's blocks plus ``pad_block``, the last, which no
    sequence of the engine owns (captured decode batches point their padding rows at it)."""

    def __init__(self, shape: KVShape, device: torch.device, dtype: torch.dtype = torch.float32):
        self.shape = shape
        self.pad_block = shape.n_blocks
        dims = (shape.n_layers, shape.n_kv_heads, (shape.n_blocks + 1) * shape.block_size, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)
        self.k_scale = self.v_scale = self.rotation = None
        if dtype == torch.int8:
            scales = (*dims[:3], shape.head_dim // kv_q8.GROUP)
            self.k_scale = torch.zeros(scales, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(scales, dtype=torch.float16, device=device)
            self.rotation = kv_q8.hadamard(shape.head_dim, device)

    def __len__(self) -> int:
        return self.shape.n_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | kv_q8.Int8Layer:
        if self.rotation is not None:
            return kv_q8.Int8Layer(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
                                   self.rotation)
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else 2 * self.k_scale.numel() * self.k_scale.element_size()
        return 2 * self.k.numel() * self.k.element_size() + scales


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
    samples_on_device = True

    def __init__(self, device: str | torch.device = "cuda", *, exact: bool = False, graphs: bool = True,
                 q8: bool = True, pdl: bool | None = None, compile_ahead: bool = True):
        """``exact``: every matmul and attention in IEEE fp32, KV cache in fp32. Otherwise prefill matmuls run on
        bf16 tensor cores, decode matmuls of up to INT8_MAX_ROWS rows on int8 activations (q8gemv.py;
        ``q8=False``: float activations), the KV cache is fp16 and attention multiplies on tensor cores
        (flash_decode.py's ``_dot``). ``graphs``: :meth:`capture` records CUDA graphs. ``pdl``: programmatic
        dependent launch (pdl.py); None: on where the GPU has it (sm_90+), never under the interpreter.
        ``compile_ahead``: the kernels a new shape's forward launches compile side by side first
        (compile_ahead.py; off: each as it is first launched)."""
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        if on_gpu and not torch.cuda.is_available():
            raise NoCUDAError()
        self.exact = exact
        self.q8 = q8 and not exact
        self.kv_dtype = torch.float32 if exact else torch.float16
        self.kv_itemsize = 4 if exact else 2
        self.decode_dot = "ieee" if exact else "half"
        self.graphs = graphs and on_gpu
        self.asynchronous = on_gpu  # kernels are queued: the engine may queue a step before reading the last one
        hopper = on_gpu and torch.cuda.get_device_capability(self.device)[0] >= 9
        self.pdl = hopper if pdl is None else pdl and hopper
        self.kernels_ahead = compile_ahead and on_gpu and compiles_ahead()
        self._primer: threading.Thread | None = None
        if on_gpu:
            self._primer = threading.Thread(target=_prime_triton, daemon=True)
            self._primer.start()
        self._buffers: dict[str, torch.Tensor] = {}
        self._recorder = GraphRecorder(self.device) if on_gpu else None
        self._decode_scratch: dict[tuple, flash_decode.DecodeScratch] = {}
        self._argmax: ArgmaxRows | None = None
        self._argmax_outgrown: list[ArgmaxRows] = []  # scratch that captured graphs may still read
        self._staging: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # pinned copies of graph inputs
        # int8 (decode) and bf16 word-order (prefill) copies of activations, written by their producers
        self._copies = ActivationCopies(self.device, q8=self.q8, words=not exact, buffer=self.buffer, pdl=self.pdl)
        # the bf16 scratch prefill GEMMs dequantize a weight into (gemm.dequantizes), made at the first such GEMM
        # for the largest layer matrix loaded, and never replaced (graphs may read it): a larger one takes the
        # fused GEMM instead
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
        ``dequantizes``), a weight larger than the scratch, or no memory for it (the fused GEMM then runs)."""
        if not dequantizes(m, w, self.exact):
            return None
        if self._dequant_scratch is None:
            # made by an eager forward (a capture runs its forward eagerly first)
            assert self._recorder is None or not self._recorder.capturing
            try:
                self._dequant_scratch = torch.empty(max(self._dequant_size, w.n * w.k), dtype=torch.bfloat16,
                                                    device=self.device)
            except torch.OutOfMemoryError:
                return None
        return self._dequant_scratch if self._dequant_scratch.numel() >= w.n * w.k else None

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

    def to_host_later(self, a: torch.Tensor) -> Callable[[], np.ndarray]:
        """See Backend.to_host_later: into pinned memory, behind an event (``to_host`` would wait for every step
        queued since: a step queued ahead would never overlap the host's work)."""
        if self.device.type != "cuda":
            return super().to_host_later(a)
        pinned = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
        pinned.copy_(a, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> np.ndarray:
            done.synchronize()
            return pinned.numpy()

        return read

    def write(self, dst: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        """Copy ``host`` into the device array ``dst`` in place (same size and dtype): the inputs a captured graph
        reads. Queued without waiting, from pinned copies of ``dst``'s own, used in turn: one is written again only
        once its last copy has run (with steps queued ahead, the copy before may still wait its turn)."""
        if self.device.type != "cuda":
            dst.copy_(torch.from_numpy(np.ascontiguousarray(host)).reshape(dst.shape))
            return dst
        ring = self._staging.get(dst.data_ptr())
        if ring is None or ring[0][0].numel() != dst.numel() or ring[0][0].dtype != dst.dtype:
            ring = self._staging[dst.data_ptr()] = [
                (torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True), torch.cuda.Event()) for _ in range(3)]
        ring.append(ring.pop(0))
        pinned, done = ring[-1]
        done.synchronize()
        pinned.numpy().reshape(-1)[:] = np.asarray(host).reshape(-1)
        dst.copy_(pinned, non_blocking=True)
        done.record()
        return dst

    def feed_tokens(self, ids: np.ndarray, previous: torch.Tensor | None,
                    source_rows: np.ndarray | None) -> torch.Tensor:
        """``ids`` on the device, the tokens of the step before gathered from ``previous`` where ``source_rows``
        says, without reading them back (one packed copy, then ``feed_tokens_into``)."""
        if previous is None or source_rows is None:
            return self.from_host(np.ascontiguousarray(ids, np.int32))
        packed = self.from_host(np.stack([np.asarray(ids, np.int32), np.asarray(source_rows, np.int32)]))
        return self.feed_tokens_into(packed[0], previous, packed[1])

    def feed_tokens_into(self, ids: torch.Tensor, previous: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """In place on the device: ``ids[i] = previous[source[i]]`` where ``source[i] >= 0`` (int32 arrays)."""
        return feed(ids, previous, source)

    def metadata(self, host: AttentionMetadata) -> AttentionMetadata:
        """``host`` as device arrays: one packed host→device copy, the fields views of it."""
        parts = [np.asarray(getattr(host, f), np.int32).reshape(-1) for f in _META_FIELDS]
        tables = np.asarray(host.block_tables, np.int32)
        packed = self.from_host(np.concatenate([*parts, tables.reshape(-1)]))
        views, o = {}, 0
        for f, p in zip(_META_FIELDS, parts):
            views[f] = packed[o:o + p.size]
            o += p.size
        views["block_tables"] = packed[o:].view(tables.shape)
        return AttentionMetadata(**views, n_seqs=host.n_seqs, max_query_len=host.max_query_len,
                                 block_size=host.block_size, fresh=host.fresh)

    def free_memory(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rope_table(inv_freq, n_ctx, self.device)

    def _kv_dtype(self, dtype: str, head_dim: int) -> torch.dtype:
        kinds = {"auto": self.kv_dtype, "f32": torch.float32, "f16": torch.float16, "q8": torch.int8}
        if dtype not in kinds:
            raise ValueError(f"the CUDA backend stores the KV pool as f32, f16 or q8, not {dtype!r}")
        if dtype == "q8" and not kv_q8.supports(head_dim):
            raise ValueError(f"an int8 KV cache needs a power-of-two head size of 32 or more, not {head_dim}")
        return kinds[dtype]

    def kv_nbytes(self, shape: KVShape, dtype: str = "auto") -> int:
        if self._kv_dtype(dtype, shape.head_dim) == torch.int8:  # a byte per value, an fp16 scale per 32
            return shape.nbytes(1) + shape.nbytes(2) // kv_q8.GROUP
        return shape.nbytes(torch.empty(0, dtype=self._kv_dtype(dtype, shape.head_dim)).element_size())

    def kv_cache(self, shape: KVShape, dtype: str = "auto") -> CUDAKVCache:
        kind = self._kv_dtype(dtype, shape.head_dim)
        try:
            return CUDAKVCache(shape, self.device, kind)
        except torch.OutOfMemoryError:
            need = self.kv_nbytes(shape, dtype)
            raise QuantaError(f"the KV pool of {shape.n_slots:,} tokens ({need / 2**30:.1f} GiB) does not fit in "
                              f"the GPU's free memory next to the weights; give it less memory (--kv-memory, "
                              f"--kv-blocks) or lower n_ctx (--n-ctx)") from None

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self._recorder is not None and self._recorder.capturing:  # the graph's own storage
            return self._recorder.buffer(name, shape)
        size = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self._buffers[name] = torch.empty(size, dtype=torch.float32, device=self.device)
        return buf[:size].view(shape)

    def capture(self, forward: Callable[[], torch.Tensor], *,
                share_rows: int | None = None) -> Callable[[], torch.Tensor] | None:
        """See Backend.capture. ``share_rows``: the graph's buffers are the set it shares with the other graphs
        recorded so (sized for that many rows): graphs that never run at the same time (graphs.py)."""
        if not self.graphs or self._recorder is None:
            return None
        self.compile_ahead(forward)
        return self._recorder.record(forward, share_rows)

    def compile_ahead(self, forward: Callable[[], Any]) -> int:
        """See Backend.compile_ahead: a dry run of ``forward`` compiles its kernels side by side
        (compile_ahead.py)."""
        self._join_primer()
        if not self.kernels_ahead:
            return 0

        def forward_and_draw() -> None:  # (the sampled draw's kernels too: 4.6 s to compile one by one, run 320)
            logits = forward()
            if isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.stride(1) == 1:
                draw.warm_up(logits)

        try:
            return dry_run_compiling(forward_and_draw, self.device)
        except Exception as e:  # noqa: BLE001 - the real forward compiles what is left (and raises a real error)
            self.kernels_ahead = False
            warnings.warn(f"compiling kernels ahead failed ({type(e).__name__}: {e}); they compile as they are "
                          f"first launched", RuntimeWarning, stacklevel=2)
            return 0

    # ---- ops -------------------------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, w: PackedWeight, *, out: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        xq, xw = self._copies.matmul_input(x, [out] if out is not None else [], w.kind)
        return qmatmul(x, w, out=out, residual=residual, bias=bias, exact=self.exact, xq=xq, xw=xw,
                       scratch=self._scratch_for(x.shape[0], w), pdl_on=self.pdl)

    def matmul_split(self, x: torch.Tensor, w: FusedWeight, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        assert [o.shape[-1] for o in outs] == list(w.widths), ([o.shape for o in outs], w.widths)
        xq, xw = self._copies.matmul_input(x, outs, w.packed.kind)
        qmatmul(x, w.packed, bias=w.bias, outs=outs, exact=self.exact, xq=xq, xw=xw,
                scratch=self._scratch_for(x.shape[0], w.packed), pdl_on=self.pdl)
        return outs

    def embed(self, w: PackedWeight, token_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        self._join_primer()
        self._copies.produce(None)
        return _embed(w, token_ids, out=out, pdl_on=self.pdl)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(x)
        q8, words = self._copies.produce(out)
        return norm.rms_norm(x, weight, eps, out=out, residual=residual, q8=q8, words=words, pdl_on=self.pdl)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, table: Any, *, neox: bool) -> torch.Tensor:
        self._copies.produce(None)
        return rope.rope(x, positions, table, neox, self.pdl)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata, table: Any, *, neox: bool,
                v: torch.Tensor | None = None, cache: Any = None) -> bool:
        self._copies.produce(None)
        if isinstance(cache, kv_q8.Int8Layer) and v is not None:  # rope, rotation and int8 store in one launch
            kv_q8.write(q, k, v, cache, meta.slots, rope=(meta.positions, table, neox), pdl_on=self.pdl)
            return True
        rope.rope_qk(q, k, meta.positions, table, neox, v=v, cache=cache, slots=meta.slots, pdl_on=self.pdl)
        return v is not None and cache is not None

    def qkv_rope(self, x: torch.Tensor, groups: list[Any], outs: dict[str, torch.Tensor], meta: AttentionMetadata,
                 table: Any, *, neox: bool, cache: Any) -> bool:
        """Decode (the rows a GEMV takes): each Q/K/V GEMV rotates its rows and stores keys and values in its
        epilogue (rope.py's ``rope_store``): the rope_qk launch goes. Needs full-width rope and quantized weights
        whose GEMV row tile is even (rotated pairs in one program)."""
        q = outs["attn_q"]
        m = x.shape[0]
        nq, nk = q.shape[1], outs["attn_k"].shape[1]
        if isinstance(cache, kv_q8.Int8Layer):  # rope_qk writes the int8 pool (kv_q8.write)
            return False
        if m > INT8_MAX_ROWS or cache is None or 2 * table[0].shape[1] != cache[0].shape[2]:
            return False
        int8 = self._copies.q8_copy(x) is not None
        parts = []
        for g in groups:
            w, bias = (g.weight.packed, g.weight.bias) if g.fused else (g.weight, g.bias)
            if not rope_fits(m, w, int8):
                return False
            parts.append((w, bias, {"attn_q": 0, "attn_k": nq, "attn_v": nq + nk}[g.names[0]]))
        xq, _ = self._copies.matmul_input(x, [q], parts[0][0].kind)
        for w, bias, row0 in parts:
            qmatmul(x, w, bias=bias, exact=self.exact, xq=xq, pdl_on=self.pdl,
                    rope=rope.RopeStore(q, cache, meta.positions, meta.slots, table, neox, row0, nq, nk))
        return True

    def attention(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: Any,
                  meta: AttentionMetadata, *, scale: float, window: int = 0, softcap: float = 0.0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        n, n_heads, hd = q.shape
        if out is None:
            out = torch.empty((n, n_heads * hd), dtype=torch.float32, device=self.device)
        decode = meta.max_query_len == 1
        int8 = cache if isinstance(cache, kv_q8.Int8Layer) else None
        if int8 is not None:
            if k is not None:  # None: rope_qk stored them and rotated q
                kv_q8.write(q, k, v, int8, meta.slots, pdl_on=self.pdl)
            k_cache, v_cache = int8.k, int8.v
        else:
            k_cache, v_cache = cache
            if k is not None:  # None: rope_qk stored them
                attention.write_kv(k, v, k_cache, v_cache, meta.slots, self.pdl)
        q8, words = self._copies.produce(out, q8=decode and flash_decode.writes_q8(hd), words=hd % 32 == 0)
        scratch = self._scratch(n, n_heads, k_cache.shape[0], meta.block_tables.shape[1] * meta.block_size,
                                hd) if decode else None
        return attention.attention(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap,
                                   out=out, scratch=scratch, exact=self.exact, q8=q8, words=words, int8=int8,
                                   pdl_on=self.pdl)

    def _scratch(self, n: int, heads: int, kv_heads: int, max_keys: int, hd: int) -> flash_decode.DecodeScratch:
        """The decode kernel's partials for ``n`` tokens (rounded up to a power of two): one per shape, never
        replaced (captured graphs read them)."""
        rows = 1 << (n - 1).bit_length()
        keys = 1 << (max_keys - 1).bit_length()
        key = (rows, heads, kv_heads, keys, hd)
        s = self._decode_scratch.get(key)
        if s is None:
            s = self._decode_scratch[key] = flash_decode.DecodeScratch(rows, heads, kv_heads, keys, hd, self.device,
                                                                       dot=self.decode_dot)
        return s

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if out is not None else torch.empty_like(gate)
        return activation.silu_mul(gate, up, out, *self._copies.produce(out), pdl_on=self.pdl)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        out = out if out is not None else torch.empty_like(gate)
        return activation.gelu_mul(gate, up, out, *self._copies.produce(out), pdl_on=self.pdl)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self._copies.produce(None)
        return activation.add_(a, b, self.pdl)

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        self._copies.produce(None)
        return activation.scale_(x, s, self.pdl)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        self._copies.produce(None)
        return activation.softcap_(x, cap, self.pdl)

    def gather_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self._copies.produce(None)
        return x.index_select(0, rows)

    def argmax_rows(self, logits: torch.Tensor, masks: np.ndarray | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """See Backend.argmax_rows; ``out``: where to write the tokens (a captured decode step's, engine/graphs.py)."""
        r, n = logits.shape
        if self._argmax is None or self._argmax.n != n or self._argmax.rows < r:
            if self._argmax is not None:
                self._argmax_outgrown.append(self._argmax)
            self._argmax = ArgmaxRows(max(r, self._argmax.rows if self._argmax else 0), n, self.device)
        return self._argmax(logits, self.pdl, None if masks is None else self._upload(masks), out)

    def sample_rows(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """See Backend.sample_rows (draw.py)."""
        return draw.sample_rows(logits, rows, self.argmax_rows, self._upload)

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A copy of ``a`` on the device, queued without waiting for the work before it (through pinned memory,
        which the caching host allocator keeps until the copy is done); ``a`` may be overwritten at once."""
        if self.device.type != "cuda":
            return torch.from_numpy(a.copy())
        pinned = torch.empty(a.shape, dtype=_host_tensor(a).dtype, pin_memory=True)
        pinned.numpy()[...] = a
        return pinned.to(self.device, non_blocking=True)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _join_primer(self) -> None:
        if self._primer is not None:  # the first launch would hash Triton's sources again while the thread does
            self._primer.join()
            self._primer = None
