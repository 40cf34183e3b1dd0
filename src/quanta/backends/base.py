"""The op interface every backend implements: the model forward is written once against it.

Arrays are backend-owned (numpy on the CPU, torch tensors on CUDA); the model only uses ``.shape`` and
``.reshape(...)`` (a view of a contiguous array) on them, never their values. Shapes
use rows = tokens: a batch of ``n`` tokens of width ``d`` is ``(n, d)``; per-head views are ``(n, heads, hd)``.
Ops that take ``out=`` write into it and return it (``out=None``: the op allocates). Ops documented as
"in place" modify their first argument and return it.

A forward runs the tokens of one or more sequences at once (a batch): :class:`AttentionMetadata` says where each
token sits (its position, the KV-pool slot its K/V go to, its sequence's block table). The KV cache is a pool of
fixed-size blocks shared by all sequences (paged attention); the engine's block manager hands blocks out. Every
op except attention treats rows independently, so a token's values do not depend on what else is in its batch.
The loop that drives the model (batches, graphs, sampling) is the engine's model runner, not a backend's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import numpy as np

from quanta.gguf import TensorInfo

Array = Any  # numpy.ndarray on the CPU, torch.Tensor on CUDA
Weight = Any  # a backend's prepared quantized weight (GGUF blocks, possibly repacked)


def allowed_tokens(masks: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool (..., n_vocab) of packed token masks (llguidance's layout: int32 words, bit ``i % 32`` of word
    ``i // 32`` set when token ``i`` is allowed); tokens past the masks' words are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=-1, bitorder="little")[..., :n_vocab]
    if bits.shape[-1] < n_vocab:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], n_vocab - bits.shape[-1]), np.uint8)], axis=-1)
    return bits.view(bool)


@dataclass(frozen=True)
class KVShape:
    """What the KV pool must hold: per layer one K and one V of ``(n_kv_heads, n_blocks * block_size, head_dim)``.

    Block ``b`` holds slots ``b*block_size .. (b+1)*block_size - 1``; a sequence's position ``p`` sits at slot
    ``block_table[p // block_size] * block_size + p % block_size``."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_blocks: int
    block_size: int

    @property
    def n_slots(self) -> int:
        return self.n_blocks * self.block_size

    def nbytes(self, itemsize: int) -> int:
        """The pool's size with ``itemsize`` bytes per cached value."""
        return 2 * self.n_layers * self.n_kv_heads * self.n_slots * self.head_dim * itemsize

    def bytes_per_block(self, itemsize: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.block_size * self.head_dim * itemsize


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the ``n`` tokens of a forward sit, for ``s`` sequences (backend int32 arrays, built by the model runner).

    Tokens are grouped by sequence, in position order: sequence ``j`` owns tokens ``query_starts[j] ..
    query_starts[j+1] - 1``. Token ``i`` is at ``positions[i]`` of its sequence ``token_seq[i]``, writes its K/V to
    pool slot ``slots[i]`` and attends to its sequence's positions ``<= positions[i]`` (through the sequence's row of
    ``block_tables``; entries past its blocks are undefined). ``seq_lens[j]`` is sequence j's length once this
    forward has run (its last token's position + 1). Rows of a padded batch (CUDA graphs) may repeat a harmless
    dummy sequence. The host ints size kernel launches: ``max_query_len`` (1 for a decode-only batch).
    ``prefill`` (host (s,) bool, or None: no prefill) marks the sequences whose chunk computes more than one token
    of their own (a prompt chunk, a recomputation), as opposed to a decode row and its drafts: a backend may pick
    kernels by it, so that a row's result does not depend on what else is in its batch. ``fresh`` (decode
    batches): how many of each token's last positions, its own included, this forward stores: 1, or for a verify
    step run as decode rows (one per token, engine/model_runner.py's ``decode_rows``) 1 + the most drafts, since a
    draft's row reads the keys the rows before it store in the same forward."""

    positions: Array  # (n,)
    slots: Array  # (n,)
    token_seq: Array  # (n,)
    block_tables: Array  # (s, max_blocks)
    seq_lens: Array  # (s,)
    query_starts: Array  # (s + 1,)
    n_seqs: int
    max_query_len: int
    block_size: int
    prefill: np.ndarray | None = None
    fresh: int = 1


@dataclass(frozen=True)
class SamplingRows:
    """What a batch's rows sample with on the device (host arrays, one entry per logits row, built by the engine's
    sampler): ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p``, ``min_p`` and ``uniform``, each row's
    draw in [0, 1) from its request's seeded generator; the logit adjustments as (row, token) entries, each pair
    once: ``bias`` is added, then, where ``counts`` (the token's occurrences in the row's penalty window) is
    positive, the row's repetition penalty divides a positive logit (multiplies a negative one) and its presence and
    frequency penalties are subtracted (engine/sampler.py's ``adjust``, in the same float32 arithmetic)."""

    temperature: np.ndarray  # float32 (r,)
    top_k: np.ndarray  # int32 (r,)
    top_p: np.ndarray  # float32 (r,)
    min_p: np.ndarray  # float32 (r,)
    uniform: np.ndarray  # float64 (r,)
    repeat_penalty: np.ndarray  # float32 (r,)
    presence_penalty: np.ndarray  # float32 (r,)
    frequency_penalty: np.ndarray  # float32 (r,)
    adjust_rows: np.ndarray  # int32 (e,)
    adjust_ids: np.ndarray  # int32 (e,)
    bias: np.ndarray  # float32 (e,)
    counts: np.ndarray  # float32 (e,)


class Backend(ABC):
    """A device: owns the arrays, the prepared weights, the KV pool and the ops on them."""

    name: str = "base"
    kv_itemsize: int = 4  # bytes per cached K or V value
    graphs: bool = False  # whether :meth:`capture` records replayable graphs
    asynchronous: bool = False  # whether work is queued (a device): the engine then queues a step ahead
    samples_on_device: bool = False  # whether :meth:`sample_rows` exists (else the engine samples on the host)

    def free_memory(self) -> int | None:
        """Bytes this device can still allocate, or None where unknown."""
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

    def to_host_later(self, a: Array) -> Callable[[], np.ndarray]:
        """A copy of ``a`` to the host, queued now behind the work that writes it; calling the result waits for
        that copy alone (not for work queued after it) and returns it. The default copies at once (``to_host`` may
        be a view, and ``a`` may be written again before the result is read)."""
        host = np.array(self.to_host(a))
        return lambda: host

    def metadata(self, host: AttentionMetadata) -> AttentionMetadata:
        """``host`` (numpy arrays) as backend arrays."""
        arrays = {f: self.from_host(np.ascontiguousarray(getattr(host, f), np.int32))
                  for f in ("positions", "slots", "token_seq", "block_tables", "seq_lens", "query_starts")}
        return AttentionMetadata(**arrays, n_seqs=host.n_seqs, max_query_len=host.max_query_len,
                                 block_size=host.block_size)

    def feed_tokens(self, ids: np.ndarray, previous: Array | None, source_rows: np.ndarray | None) -> Array:
        """A forward's token ids as a backend int32 array: ``ids``, except where ``source_rows[i] >= 0``: there, the
        token ``previous[source_rows[i]]`` that the step before sampled and left on the device (so the next step
        can be queued before the host has read it). The default reads ``previous`` back (a device backend keeps it
        on the device)."""
        if previous is not None and source_rows is not None:
            ids = np.where(source_rows >= 0, self.to_host(previous)[np.maximum(source_rows, 0)], ids)
        return self.from_host(np.ascontiguousarray(ids, np.int32))

    @abstractmethod
    def rope_table(self, inv_freq: np.ndarray, n_ctx: int) -> Any:
        """Precomputed cos/sin for positions 0..n_ctx-1 and the ``len(inv_freq)`` rotary frequencies
        (inv_freq already holds any per-frequency factors and scaling)."""

    @abstractmethod
    def kv_cache(self, shape: KVShape, dtype: str = "auto") -> Any:
        """The KV pool, allocated once, its values stored as ``dtype`` ("auto": the backend's default for its mode;
        "f32", "f16", "q8": int8 with a scale per token and KV head; a backend refuses what it lacks with a
        ValueError); :meth:`attention` writes into it.

        The returned object must support ``len(cache) == n_layers`` and ``cache[layer]`` (passed to attention)."""

    def kv_nbytes(self, shape: KVShape, dtype: str = "auto") -> int:
        """Bytes :meth:`kv_cache` takes for ``shape`` and ``dtype``."""
        return shape.nbytes(self.kv_itemsize)

    @abstractmethod
    def buffer(self, name: str, shape: tuple[int, ...]) -> Array:
        """A float32 scratch array reused by every call with the same ``name`` (contents undefined).

        The forward takes its intermediates from here, so the decode path allocates nothing once warm; a
        buffer is valid until the next call with the same name."""

    def capture(self, forward: Callable[[], Array], *, share_rows: int | None = None) -> Callable[[], Array] | None:
        """``forward`` (which reads only inputs the caller rewrites in place between calls, with :meth:`write`)
        recorded once as a replayable graph: the returned function replays it and returns the same output array.
        ``share_rows``: its intermediates live in a set shared with the other graphs recorded so (sized for that many
        rows; graphs that never run at once). None where this backend records no graphs (the caller then runs
        ``forward`` itself)."""
        return None

    def compile_ahead(self, forward: Callable[[], Any]) -> int:
        """Prepare what ``forward``'s first run would compile as it goes (a GPU backend's kernels, all at once);
        how many things it prepared (0 where a backend compiles nothing lazily). ``forward`` may run, but its
        results are not used."""
        return 0

    def write(self, dst: Array, host: np.ndarray) -> Array:
        """Copy ``host`` into the backend array ``dst`` in place (same size and dtype)."""
        dst[...] = host.reshape(dst.shape)
        return dst

    def feed_tokens_into(self, ids: Array, previous: Array, source: Array) -> Array:
        """In place: ``ids[i] = previous[source[i]]`` where ``source[i] >= 0`` (int32 backend arrays)."""
        src = self.to_host(source)
        taken = self.to_host(previous)[np.maximum(src, 0)]
        self.write(ids, np.where(src >= 0, taken, self.to_host(ids)).astype(np.int32))
        return ids

    # ---- ops -------------------------------------------------------------------------------------------------
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

    def rope_qk(self, q: Array, k: Array, meta: AttentionMetadata, table: Any, *, neox: bool,
                v: Array | None = None, cache: Any = None) -> bool:
        """:meth:`rope` of the queries and the keys (one pass on a device). With ``v`` and ``cache``, a backend
        may also store the rotated k and v at ``meta.slots`` of ``cache``: it returns True when it did (then
        :meth:`attention` gets ``k = v = None``). The default rotates only and returns False."""
        self.rope(q, meta.positions, table, neox=neox)
        self.rope(k, meta.positions, table, neox=neox)
        return False

    def qkv_rope(self, x: Array, groups: list[Any], outs: dict[str, Array], meta: AttentionMetadata, table: Any,
                 *, neox: bool, cache: Any) -> bool:
        """Optional decode fusion: the Q/K/V projections of ``groups`` (the model's ``Projection`` list) with the
        rope of :meth:`rope_qk` and the K/V store done by the matmuls themselves; ``outs["attn_q"]`` gets the
        rotated queries, the cache the keys and values. True when done; the default returns False and the caller
        runs the matmuls and :meth:`rope_qk`."""
        return False

    @abstractmethod
    def attention(self, q: Array, k: Array | None, v: Array | None, cache: Any, meta: AttentionMetadata, *,
                  scale: float, window: int = 0, softcap: float = 0.0, out: Array | None = None) -> Array:
        """Causal multi-head attention over the paged KV cache; returns (n, n_heads * hd).

        q: (n, n_heads, hd); k, v: (n, n_kv_heads, hd) for the new tokens, first written to ``cache`` at
        ``meta.slots`` (None: :meth:`rope_qk` already stored them). Token i attends to the positions p of its
        sequence with ``p <= positions[i]`` and, when ``window > 0``, ``p > positions[i] - window``. GQA: query head
        h reads kv head ``h // (n_heads // n_kv_heads)``. Scores are ``q·k * scale``, then
        ``softcap * tanh(s / softcap)`` when ``softcap > 0``, then softmax."""

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
    def gather_rows(self, x: Array, rows: Array) -> Array:
        """Rows ``rows`` (int32 indices) of (n, d) as a new (len(rows), d) array (the rows that need logits)."""

    @abstractmethod
    def argmax_rows(self, logits: Array, masks: np.ndarray | None = None) -> Array:
        """The greedy token of each row of (n, vocab) as int32 (n,); -1 for a row whose largest value is not
        finite (NaN or inf logits: a broken model). ``masks``: host int32 (n, words), row i's allowed tokens as
        packed bits (:func:`allowed_tokens`); the others count as -inf (-1 when none is allowed). The backend
        is done with ``masks`` when this returns (the caller may overwrite it)."""

    def sample_rows(self, logits: Array, rows: SamplingRows) -> Array:
        """Each row's token drawn from its adjusted logits (:class:`SamplingRows`) as int32 (n,), left on the device:
        the host sampler's choice (engine/sampler.py's ``sample_row`` with the same uniform) up to float rounding;
        -1 for a row whose logits are not finite. Only where :attr:`samples_on_device`."""
        raise NotImplementedError(f"the {self.name} backend samples on the host")

    def synchronize(self) -> None:
        """Wait for queued work (for timing); a no-op on the CPU."""
