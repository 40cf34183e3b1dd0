"""What every architecture shares: loading its tensors onto a backend, rope tables, the decoder-layer pieces.

An architecture file subclasses :class:`Model`, names its tensors and writes ``forward`` against the op
interface (quanta.backends.base.Backend); nothing here touches array values directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from quanta.backends.base import Array, AttentionMetadata, Backend, KVShape
from quanta.errors import QuantaError
from quanta.gguf import GGUFFile, TensorInfo
from quanta.models.config import ModelConfig

if TYPE_CHECKING:
    from quanta.parallel.group import TensorParallel

# per-layer tensors every decoder layer has (``blk.{i}.{name}.weight``)
ATTN_FFN_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QKV = ("attn_q", "attn_k", "attn_v")  # projections of the same normed input: candidates for one fused matmul
GATE_UP = ("ffn_gate", "ffn_up")
BIAS_OF = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}  # optional bias attributes (qwen2)


@dataclass
class Projection:
    """One matmul of a shared input: a single weight (with its optional bias) or several the backend fused."""

    weight: Any
    names: tuple[str, ...]
    fused: bool
    bias: Array | None = None  # single weights only: a fused weight carries its biases


def _bias(layer: SimpleNamespace, matrix: str) -> Array | None:
    return getattr(layer, BIAS_OF[matrix], None) if matrix in BIAS_OF else None


def rope_inv_freq(base: float, rope_dim: int, scale: float = 1.0, factors: np.ndarray | None = None) -> np.ndarray:
    """Rotary frequencies ``base^(-2i/d) / factors[i] / scale`` (float32, as HF and llama.cpp compute them)."""
    inv = (1.0 / (np.float32(base) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))))
    if factors is not None:
        inv = inv / factors.astype(np.float32)
    return (inv / np.float32(scale)).astype(np.float32)


class Model:
    """A decoder-only transformer over quantized weights held by one backend."""

    arch: str = ""
    neox_rope: bool = False  # False: llama's adjacent pairs; True: halves (qwen2, gemma)

    def __init__(self, gguf: GGUFFile, config: ModelConfig, backend: Backend, n_ctx: int,
                 parallel: TensorParallel | None = None):
        """``n_ctx``: the longest sequence (positions) the rotary tables cover. ``parallel``: this model is one
        rank's part of a tensor-parallel group (quanta.parallel): ``config`` then becomes that rank's heads and FFN
        width, and the forward's collectives join the ranks' parts."""
        self.parallel = parallel
        self.config = config if parallel is None else parallel.plan.local_config(config)
        self.backend, self.n_ctx = backend, n_ctx
        self.gguf = gguf
        self._check_context_fits()
        self.tok_embd = self.matrix("token_embd.weight")
        self.output_norm = self.vector("output_norm.weight")
        # tied embeddings: no output.weight, the embedding matrix doubles as the lm head
        lm_head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        if parallel is not None:
            self.output = backend.load_weight(parallel.plan.lm_head(self.tensor(lm_head)))
        else:
            self.output = self.tok_embd if lm_head == "token_embd.weight" else self.matrix(lm_head)
        self.n_vocab = self.tensor(lm_head).shape[0]
        self.layers = [self.fuse_layer(self.load_layer(i)) for i in range(config.n_layers)]

    # ---- loading ---------------------------------------------------------------------------------------------
    def _check_context_fits(self) -> None:
        """Before anything is allocated: one sequence of n_ctx positions (its KV cache and the rotary tables)
        against the device's free memory (a context the machine cannot hold is a clear error, not an allocation
        failure or the OOM killer)."""
        free = self.backend.free_memory()
        need = self.backend.kv_nbytes(self.kv_shape(self.n_ctx, 1)) + self.n_ctx * 4 * self.config.rope_dim
        if free is not None and need > free:
            raise QuantaError(f"n_ctx {self.n_ctx:,} needs {need / 2**30:,.1f} GiB for one sequence's KV cache, and "
                              f"the {self.backend.name} device has {free / 2**30:,.1f} GiB free; lower n_ctx "
                              f"(--n-ctx)")

    def tensor(self, name: str) -> TensorInfo:
        return self.gguf.tensors[name]  # present with the right shape and type: load_model validated the file

    def _part(self, name: str) -> TensorInfo:
        """The tensor, or this rank's part of it."""
        t = self.tensor(name)
        return t if self.parallel is None else self.parallel.plan.tensor(t)

    def matrix(self, name: str) -> Any:
        return self.backend.load_weight(self._part(name))

    def vector(self, name: str) -> Array:
        return self.backend.load_vector(self._part(name))

    def load_layer(self, i: int) -> SimpleNamespace:
        """The layer's matrices (``attn_q`` …) and norms; architectures extend it with their extra tensors."""
        p = f"blk.{i}."
        layer = SimpleNamespace(**{m: self.matrix(p + m + ".weight") for m in ATTN_FFN_MATRICES})
        layer.attn_norm = self.vector(p + "attn_norm.weight")
        layer.ffn_norm = self.vector(p + "ffn_norm.weight")
        return layer

    def fuse_layer(self, layer: SimpleNamespace) -> SimpleNamespace:
        """Group the Q/K/V and gate/up matrices into as few matmuls as the backend can fuse (``layer.qkv``,
        ``layer.gate_up``: lists of :class:`Projection`); fused matrices replace the separate ones."""
        layer.qkv = self.projections(layer, QKV)
        layer.gate_up = self.projections(layer, GATE_UP)
        return layer

    def projections(self, layer: SimpleNamespace, names: tuple[str, ...]) -> list[Projection]:
        """Greedy: the longest run of consecutive ``names`` the backend fuses (formats must match), else one."""
        groups, i = [], 0
        while i < len(names):
            for j in range(len(names), i + 1, -1):
                run = names[i:j]
                w = self.backend.fuse([getattr(layer, n) for n in run], [_bias(layer, n) for n in run])
                if w is not None:
                    groups.append(Projection(w, run, True))
                    for n in run:
                        delattr(layer, n)
                    break
            else:
                j = i + 1
                groups.append(Projection(getattr(layer, names[i]), names[i:j], False, _bias(layer, names[i])))
            i = j
        return groups

    def project(self, h: Array, groups: list[Projection], outs: dict[str, Array]) -> None:
        """``outs[name] = h @ W_name.T (+ bias)`` for every matrix of ``groups``."""
        ops = self.backend
        for g in groups:
            if g.fused:
                ops.matmul_split(h, g.weight, [outs[n] for n in g.names])
            else:
                ops.matmul(h, g.weight, out=outs[g.names[0]], bias=g.bias)

    def kv_shape(self, n_blocks: int, block_size: int) -> KVShape:
        """The KV pool of ``n_blocks`` blocks of ``block_size`` tokens for this model's layers and heads."""
        c = self.config  # (key and value heads of one size: load_model validated it)
        return KVShape(c.n_layers, c.n_kv_heads, c.head_dim, n_blocks, block_size)

    # ---- shared pieces of the forward ------------------------------------------------------------------------
    def qkv(self, h: Array, layer: SimpleNamespace) -> tuple[Array, Array, Array]:
        """Projections of the normed input (biases included), reshaped to (n, heads, head_dim)."""
        outs = self._qkv_buffers(h.shape[0])
        self.project(h, layer.qkv, outs)
        return self._heads(outs)

    def qkv_rope(self, h: Array, layer: SimpleNamespace, layer_cache: Any, meta: AttentionMetadata,
                 rope: Any) -> tuple[Array, Array | None, Array | None]:
        """:meth:`qkv` then :meth:`rope_store`; one pass where the backend fuses them (``Backend.qkv_rope``)."""
        outs = self._qkv_buffers(h.shape[0])
        if self.backend.qkv_rope(h, layer.qkv, outs, meta, rope, neox=self.neox_rope, cache=layer_cache):
            return self._heads(outs)[0], None, None
        self.project(h, layer.qkv, outs)
        return self.rope_store(*self._heads(outs), layer_cache, meta, rope)

    def _qkv_buffers(self, n: int) -> dict[str, Array]:
        ops, c = self.backend, self.config
        return {"attn_q": ops.buffer("q", (n, c.n_heads * c.head_dim)),
                "attn_k": ops.buffer("k", (n, c.n_kv_heads * c.head_dim)),
                "attn_v": ops.buffer("v", (n, c.n_kv_heads * c.head_dim))}

    def _heads(self, outs: dict[str, Array]) -> tuple[Array, Array, Array]:
        c, n = self.config, outs["attn_q"].shape[0]
        return (outs["attn_q"].reshape(n, c.n_heads, c.head_dim), outs["attn_k"].reshape(n, c.n_kv_heads, c.head_dim),
                outs["attn_v"].reshape(n, c.n_kv_heads, c.head_dim))

    def rope_store(self, q: Array, k: Array, v: Array, layer_cache: Any, meta: AttentionMetadata,
                   rope: Any) -> tuple[Array, Array | None, Array | None]:
        """Rope of q and k; k and v come back None when the backend also stored them in the cache."""
        if self.backend.rope_qk(q, k, meta, rope, neox=self.neox_rope, v=v, cache=layer_cache):
            return q, None, None
        return q, k, v

    def attend(self, q: Array, k: Array | None, v: Array | None, layer_cache: Any, meta: AttentionMetadata,
               layer: SimpleNamespace, *, window: int = 0, residual: Array | None = None) -> Array:
        """Attention of the rotated q over the cache (k and v first stored unless None), then the output
        projection → (n, d_model), added into ``residual`` (in place) when given."""
        ops, c, n = self.backend, self.config, q.shape[0]
        o = ops.attention(q, k, v, layer_cache, meta, scale=c.attn_scale, window=window,
                          softcap=c.attn_softcap, out=ops.buffer("attn", (n, c.n_heads * c.head_dim)))
        return self._reduced(o, layer.attn_output, residual, "attn_out")

    def ffn(self, h: Array, layer: SimpleNamespace, *, gelu: bool = False, residual: Array | None = None) -> Array:
        """Gated feed-forward ``down(act(gate(h)) * up(h))`` → (n, d_model), added into ``residual`` when given."""
        ops, c, n = self.backend, self.config, h.shape[0]
        gate, up = ops.buffer("gate", (n, c.d_ff)), ops.buffer("up", (n, c.d_ff))
        self.project(h, layer.gate_up, {"ffn_gate": gate, "ffn_up": up})
        act = (ops.gelu_mul if gelu else ops.silu_mul)(gate, up, out=gate)
        return self._reduced(act, layer.ffn_down, residual, "ffn_out")

    def _reduced(self, x: Array, w: Any, residual: Array | None, name: str) -> Array:
        """``x @ w.T`` (n, d_model), added into ``residual`` when given. Tensor parallel: ``w`` holds this rank's
        input columns, and the ranks' partial products are summed (one all-reduce; the residual is added by the
        lead alone, the others overwrite it with their part: every rank holds the same residual)."""
        ops = self.backend
        out = residual if residual is not None else ops.buffer(name, (x.shape[0], self.config.d_model))
        if self.parallel is None:
            return ops.matmul(x, w, out=out, residual=residual)
        ops.matmul(x, w, out=out, residual=residual if self.parallel.rank == 0 else None)
        return self.parallel.all_reduce(out)

    def logits(self, x: Array, rows: Array | None, residual: Array | None = None) -> Array:
        """Final norm (of ``x + residual`` when given) and lm head of the ``rows`` that need logits (all: None)."""
        ops, c = self.backend, self.config
        if rows is not None:
            x = ops.gather_rows(x, rows)
            residual = ops.gather_rows(residual, rows) if residual is not None else None
        h = ops.rms_norm(x, self.output_norm, c.norm_eps, out=ops.buffer("h_out", tuple(x.shape)), residual=residual)
        if self.parallel is None:
            out = ops.matmul(h, self.output, out=ops.buffer("logits", (x.shape[0], self.n_vocab)))
        else:  # this rank's vocabulary rows, then every rank's columns joined
            start, stop = self.parallel.plan.vocab
            out = ops.matmul(h, self.output, out=ops.buffer("logits_part", (x.shape[0], stop - start)))
        if c.final_softcap > 0:
            ops.softcap(out, c.final_softcap)
        if self.parallel is not None:
            out = self.parallel.gather_vocab(out, ops.buffer("logits", (x.shape[0], self.n_vocab)))
        return out

    def embed(self, token_ids: Array) -> Array:
        """The embeddings (n, d_model) of ``token_ids``; tensor parallel, of the lead's ids (broadcast first)."""
        if self.parallel is not None:
            token_ids = self.parallel.broadcast_ids(token_ids)
        ops, n = self.backend, token_ids.shape[0]
        return ops.embed(self.tok_embd, token_ids, out=ops.buffer("x", (n, self.config.d_model)))

    def forward(self, token_ids: Array, meta: AttentionMetadata, cache: Any, logit_rows: Array | None) -> Array:
        """Logits (len(logit_rows), vocab) of a batch of tokens placed by ``meta`` (every row's: ``None``); each
        token's K/V is written to the cache first."""
        raise NotImplementedError
