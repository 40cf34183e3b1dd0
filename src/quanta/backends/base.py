"""The op interface every backend implements: the model forward is written once against it.

Arrays are backend-owned (numpy on the CPU, torch tensors on CUDA); the model only uses ``.shape`` and
``.reshape(...)`` (a view of a contiguous array) on them, never their values. Shapes
use rows = tokens: a batch of ``n`` tokens of width ``d`` is ``(n, d)``; per-head views are ``(n, heads, hd)``.
Ops that take ``out=`` write into it and return it (``out=None``: the op allocates). Ops documented as
"in place" modify their first argument and return it.

Positions are a backend int32 array of the absolute positions of the ``n`` tokens of a forward (not a Python
int), so a backend can keep them in device memory and replay a captured decode step with a new position.

A backend may override :meth:`Backend.forward` as a whole (fuse ops, capture the decode step as a CUDA graph,
compute logits only for the last position); the default runs ``model.forward`` op by op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from quanta.gguf import TensorInfo
    from quanta.models.base import Model

Array = Any  # numpy.ndarray on the CPU, torch.Tensor on CUDA
Weight = Any  # a backend's prepared quantized weight (GGUF blocks, possibly repacked)


@dataclass(frozen=True)
class KVShape:
    """What the KV-cache arena must hold: one K and one V of ``(n_kv_heads, n_ctx, head_dim)`` per layer."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_ctx: int

    def nbytes(self, itemsize: int) -> int:
        """The arena's size with ``itemsize`` bytes per cached value."""
        return 2 * self.n_layers * self.n_kv_heads * self.n_ctx * self.head_dim * itemsize


class Backend(ABC):
    """A device: owns the arrays, the prepared weights, the KV-cache arena and the ops on them."""

    name: str = "base"
    kv_itemsize: int = 4  # bytes per cached K or V value

    def free_memory(self) -> int | None:
        """Bytes this device can still allocate, or None where unknown (then any n_ctx is tried)."""
        return None

    # ---- loading ---------------------------------------------------------------------------------------------
    @abstractmethod
    def load_weight(self, tensor: TensorInfo) -> Weight:
        """A 2-D GGUF tensor of shape (m, k) (rows first) ready for :meth:`matmul` and :meth:`embed`.

        Kept quantized: no fp32 copy of the weight may stay resident."""

    @abstractmethod
    def load_vector(self, tensor: TensorInfo) -> Array:
        """A small tensor (norm weights, biases) as a float32 backend array of the tensor's shape."""

    @abstractmethod
    def from_host(self, a: np.ndarray) -> Array:
        """Copy a host array to the backend (keeps its dtype)."""

    @abstractmethod
    def to_host(self, a: Array) -> np.ndarray:
        """A numpy copy (or view on the CPU) of a backend array."""

    @abstractmethod
    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> Any:
        """Precomputed cos/sin for positions 0..n_ctx-1 and the ``len(inv_freq)`` rotary frequencies
        (inv_freq already holds any per-frequency factors and scaling)."""

    @abstractmethod
    def kv_cache(self, shape: KVShape) -> Any:
        """The KV-cache arena, allocated once for ``shape.n_ctx`` positions; :meth:`attention` writes into it.

        The returned object must support ``len(cache) == n_layers`` and ``cache[layer]`` (passed to attention)."""

    @abstractmethod
    def buffer(self, name: str, shape: tuple[int, ...]) -> Array:
        """A float32 scratch array reused by every call with the same ``name`` (contents undefined).

        The forward takes its intermediates from here, so the decode path allocates nothing once warm; a
        buffer is valid until the next call with the same name."""

    # ---- ops -------------------------------------------------------------------------------------------------
    @abstractmethod
    def positions(self, start: int, n: int) -> Array:
        """The int32 positions ``start .. start+n-1`` as a backend array."""

    @abstractmethod
    def matmul(self, x: Array, w: Weight, *, out: Array | None = None, residual: Array | None = None,
               bias: Array | None = None) -> Array:
        """``x @ W.T (+ bias) (+ residual)``: (n, k) float32 activations times the quantized (m, k) weight →
        (n, m) float32. ``bias`` is (m,); ``residual`` is (n, m) and may be ``out`` itself (``out += x @ W.T``)."""

    def fuse(self, weights: list[Weight], biases: list[Array | None]) -> Weight | None:
        """One weight whose rows are ``weights``' rows stacked (same input width; with their biases, if any), for
        :meth:`matmul_split`; None when this backend cannot or gains nothing (the default; e.g. formats differ).

        A backend that fuses keeps no second copy: the caller drops the separate weights."""
        return None

    def matmul_split(self, x: Array, w: Weight, outs: list[Array]) -> list[Array]:
        """``x @ W.T (+ bias)`` of a :meth:`fuse`d weight, its column blocks written to ``outs`` ((n, m_i) each,
        in the order of the fused weights). Only called on weights :meth:`fuse` returned."""
        raise NotImplementedError(f"the {self.name} backend does not fuse weights")

    @abstractmethod
    def embed(self, w: Weight, token_ids: Array, *, out: Array | None = None) -> Array:
        """Rows ``token_ids`` of the quantized (vocab, d) weight, dequantized → (n, d) float32."""

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float, *, out: Array | None = None,
                 residual: Array | None = None) -> Array:
        """``x / sqrt(mean(x², last axis) + eps) * weight`` over the last axis (x may be (n, d) or (n, h, hd)).

        With ``residual`` (x's shape), first ``x += residual`` in place: the residual stream and its norm."""

    @abstractmethod
    def rope(self, x: Array, positions: Array, table: Any, *, neox: bool) -> Array:
        """Rotate (n, heads, hd) in place. ``neox=False`` (NORM, llama): pairs (2i, 2i+1); ``neox=True``
        (qwen2, gemma): pairs (i, i + rot/2). Only the first ``rot = 2 * len(inv_freq)`` dims rotate."""

    def rope_qk(self, q: Array, k: Array, positions: Array, table: Any, *, neox: bool, v: Array | None = None,
                cache: Any = None) -> bool:
        """:meth:`rope` of the queries and the keys (one pass on a device). With ``v`` and ``cache``, a backend
        may also store the rotated k and v at ``positions`` of ``cache``: it returns True when it did (then
        :meth:`attention` gets ``k = v = None``). The default rotates only and returns False."""
        self.rope(q, positions, table, neox=neox)
        self.rope(k, positions, table, neox=neox)
        return False

    def qkv_rope(self, x: Array, groups: list[Any], outs: dict[str, Array], positions: Array, table: Any, *,
                 neox: bool, cache: Any) -> bool:
        """Optional decode fusion: the Q/K/V projections of ``groups`` (the model's ``Projection`` list) with the
        rope of :meth:`rope_qk` and the K/V store done by the matmuls themselves; ``outs["attn_q"]`` gets the
        rotated queries, the cache the keys and values. True when done; the default returns False and the caller
        runs the matmuls and :meth:`rope_qk`."""
        return False

    @abstractmethod
    def attention(self, q: Array, k: Array | None, v: Array | None, cache: Any, positions: Array, *, scale: float,
                  window: int = 0, softcap: float = 0.0, out: Array | None = None) -> Array:
        """Causal multi-head attention with the KV cache; returns (n, n_heads * hd).

        q: (n, n_heads, hd); k, v: (n, n_kv_heads, hd) for the new tokens, first written to ``cache`` at
        ``positions`` (None: :meth:`rope_qk` already stored them). Query i attends to cached positions p with
        ``p <= positions[i]`` and, when ``window > 0``, ``p > positions[i] - window``. GQA: query head h reads kv
        head ``h // (n_heads // n_kv_heads)``. Scores are ``q·k * scale``, then ``softcap * tanh(s / softcap)``
        when ``softcap > 0``, then softmax."""

    @abstractmethod
    def silu_mul(self, gate: Array, up: Array, *, out: Array | None = None) -> Array:
        """``silu(gate) * up`` elementwise."""

    @abstractmethod
    def gelu_mul(self, gate: Array, up: Array, *, out: Array | None = None) -> Array:
        """``gelu_tanh(gate) * up`` elementwise (the tanh approximation)."""

    @abstractmethod
    def add(self, a: Array, b: Array) -> Array:
        """``a += b`` in place (b broadcasts over rows: biases)."""

    @abstractmethod
    def scale(self, x: Array, s: float) -> Array:
        """``x *= s`` in place."""

    @abstractmethod
    def softcap(self, x: Array, cap: float) -> Array:
        """``x = cap * tanh(x / cap)`` in place (final-logit soft-capping)."""

    @abstractmethod
    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis (new array)."""

    @abstractmethod
    def argmax(self, x: Array) -> int:
        """Index of the largest element of a 1-D array (the greedy token)."""

    def greedy_decode(self, model: Model, cache: Any, token: int, start: int, steps: int) -> Iterator[int]:
        """The greedy tokens of ``steps`` decode steps from ``token`` at position ``start`` (each step writes its
        input's K/V). A device backend may run a step ahead of the consumer: after it stops, the step after its last
        token may still write that token's K/V."""
        for i in range(steps):
            token = self.argmax(self.forward(model, np.asarray([token], np.int32), start + i, cache,
                                             all_logits=False)[0])
            yield token

    @abstractmethod
    def last_row(self, x: Array) -> Array:
        """The last row of (n, d) as a (1, d) array (for logits of the last position only)."""

    def set_threads(self, n: int) -> None:
        """Number of CPU threads for the ops (ignored by device backends)."""

    def synchronize(self) -> None:
        """Wait for queued work (for timing); a no-op on the CPU."""

    # ---- the forward -----------------------------------------------------------------------------------------
    def forward(self, model: Model, token_ids: np.ndarray, start: int, cache: Any, *,
                all_logits: bool) -> Array:
        """Logits for ``token_ids`` at positions ``start..``: (n, vocab) when ``all_logits`` else (1, vocab).

        Overridable: a backend may fuse ops or capture the decode step (n == 1) as a graph."""
        ids = self.from_host(np.ascontiguousarray(token_ids, dtype=np.int32))
        return model.forward(ids, self.positions(start, len(token_ids)), cache, all_logits=all_logits)
