"""What every architecture shares: loading its tensors onto a backend, rope tables, the decoder-layer pieces.

An architecture file subclasses :class:`Model`, names its tensors and writes ``forward`` against the op
interface (quanta.backends.base.Backend); nothing here touches array values directly.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from quanta.backends.base import Array, Backend, KVShape
from quanta.errors import QuantaError
from quanta.gguf import GGUFFile, TensorInfo
from quanta.models.config import ModelConfig

# per-layer tensors every decoder layer has (``blk.{i}.{name}.weight``)
ATTN_FFN_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


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

    def __init__(self, gguf: GGUFFile, config: ModelConfig, backend: Backend, n_ctx: int):
        self.config, self.backend, self.n_ctx = config, backend, n_ctx
        self.gguf = gguf
        self.tok_embd = self.matrix("token_embd.weight")
        self.output_norm = self.vector("output_norm.weight")
        # tied embeddings: no output.weight, the embedding matrix doubles as the lm head
        lm_head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.output = self.tok_embd if lm_head == "token_embd.weight" else self.matrix(lm_head)
        self.n_vocab = self.tensor(lm_head).shape[0]
        self.layers = [self.load_layer(i) for i in range(config.n_layers)]

    # ---- loading ---------------------------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.gguf.tensors[name]
        except KeyError:
            raise QuantaError(f"{self.gguf.path.name}: the {self.arch} model lacks tensor {name!r}") from None

    def matrix(self, name: str) -> Any:
        return self.backend.load_weight(self.tensor(name))

    def vector(self, name: str) -> Array:
        return self.backend.load_vector(self.tensor(name))

    def load_layer(self, i: int) -> SimpleNamespace:
        """The layer's matrices (``attn_q`` …) and norms; architectures extend it with their extra tensors."""
        p = f"blk.{i}."
        layer = SimpleNamespace(**{m: self.matrix(p + m + ".weight") for m in ATTN_FFN_MATRICES})
        layer.attn_norm = self.vector(p + "attn_norm.weight")
        layer.ffn_norm = self.vector(p + "ffn_norm.weight")
        return layer

    def kv_shape(self) -> KVShape:
        c = self.config
        if c.value_dim != c.head_dim:
            raise QuantaError("key and value head sizes differ; not supported")
        return KVShape(c.n_layers, c.n_kv_heads, c.head_dim, self.n_ctx)

    # ---- shared pieces of the forward ------------------------------------------------------------------------
    def qkv(self, h: Array, layer: SimpleNamespace) -> tuple[Array, Array, Array]:
        """Projections of the normed input, reshaped to (n, heads, head_dim)."""
        ops, c, n = self.backend, self.config, h.shape[0]
        q = ops.matmul(h, layer.attn_q, out=ops.buffer("q", (n, c.n_heads * c.head_dim)))
        k = ops.matmul(h, layer.attn_k, out=ops.buffer("k", (n, c.n_kv_heads * c.head_dim)))
        v = ops.matmul(h, layer.attn_v, out=ops.buffer("v", (n, c.n_kv_heads * c.head_dim)))
        for a, bias in ((q, getattr(layer, "bq", None)), (k, getattr(layer, "bk", None)),
                        (v, getattr(layer, "bv", None))):
            if bias is not None:
                ops.add(a, bias)
        return (q.reshape(n, c.n_heads, c.head_dim), k.reshape(n, c.n_kv_heads, c.head_dim),
                v.reshape(n, c.n_kv_heads, c.head_dim))

    def attend(self, q: Array, k: Array, v: Array, layer_cache: Any, positions: Array, layer: SimpleNamespace,
               *, window: int = 0) -> Array:
        """Attention over the cache, then the output projection → (n, d_model)."""
        ops, c, n = self.backend, self.config, q.shape[0]
        o = ops.attention(q, k, v, layer_cache, positions, scale=c.attn_scale, window=window,
                          softcap=c.attn_softcap, out=ops.buffer("attn", (n, c.n_heads * c.head_dim)))
        return ops.matmul(o, layer.attn_output, out=ops.buffer("attn_out", (n, c.d_model)))

    def ffn(self, h: Array, layer: SimpleNamespace, *, gelu: bool = False) -> Array:
        """Gated feed-forward: ``down(act(gate(h)) * up(h))`` → (n, d_model)."""
        ops, c, n = self.backend, self.config, h.shape[0]
        gate = ops.matmul(h, layer.ffn_gate, out=ops.buffer("gate", (n, c.d_ff)))
        up = ops.matmul(h, layer.ffn_up, out=ops.buffer("up", (n, c.d_ff)))
        act = (ops.gelu_mul if gelu else ops.silu_mul)(gate, up, out=gate)
        return ops.matmul(act, layer.ffn_down, out=ops.buffer("ffn_out", (n, c.d_model)))

    def logits(self, x: Array, all_logits: bool) -> Array:
        """Final norm and lm head (only the last row unless ``all_logits``)."""
        ops, c = self.backend, self.config
        if not all_logits:
            x = ops.last_row(x)
        h = ops.rms_norm(x, self.output_norm, c.norm_eps, out=ops.buffer("h_out", tuple(x.shape)))
        out = ops.matmul(h, self.output, out=ops.buffer("logits", (x.shape[0], self.n_vocab)))
        if c.final_softcap > 0:
            ops.softcap(out, c.final_softcap)
        return out

    def forward(self, token_ids: Array, positions: Array, cache: Any, *, all_logits: bool) -> Array:
        """Logits for the tokens at ``positions`` (see Backend.forward)."""
        raise NotImplementedError
