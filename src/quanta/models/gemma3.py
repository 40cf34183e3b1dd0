"""Gemma 3 (text): sliding-window and global attention layers, q/k RMSNorm, sandwich norms, GELU-gated FFN.

Every 6th layer (i % 6 == 5) is global; the others attend to the last ``sliding_window`` positions and use
rope base 10,000, the global ones the metadata's base (and its linear scaling). Embeddings are scaled by
sqrt(d_model). llama.cpp's converter already adds 1 to every Gemma norm weight, so the GGUF values multiply
directly (plain RMSNorm). Queries are scaled by 1/sqrt(key_length) (query_pre_attn_scalar = head_dim).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from quanta.backends.base import Array, AttentionMetadata
from quanta.models.base import Model, rope_inv_freq

SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10_000.0


class Gemma3(Model):
    arch = "gemma3"
    neox_rope = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        c = self.config
        self.rope_global = self.backend.rope_table(rope_inv_freq(c.rope_base, c.rope_dim, c.rope_scale), self.n_ctx)
        self.rope_local = self.backend.rope_table(rope_inv_freq(LOCAL_ROPE_BASE, c.rope_dim), self.n_ctx)

    def is_sliding(self, i: int) -> bool:
        return self.config.sliding_window > 0 and i % SWA_PATTERN < SWA_PATTERN - 1

    def load_layer(self, i: int) -> SimpleNamespace:
        layer = super().load_layer(i)
        for name in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
            setattr(layer, name, self.vector(f"blk.{i}.{name}.weight"))
        return layer

    def forward(self, token_ids: Array, meta: AttentionMetadata, cache: Any, logit_rows: Array | None) -> Array:
        ops, c, n = self.backend, self.config, token_ids.shape[0]
        x = self.embed(token_ids)
        ops.scale(x, math.sqrt(c.d_model))
        h_buf = ops.buffer("h", (n, c.d_model))
        pending = None  # the last sandwich-normed FFN output, added to x by the next norm (one pass, not two)
        for i, layer in enumerate(self.layers):
            sliding = self.is_sliding(i)
            h = ops.rms_norm(x, layer.attn_norm, c.norm_eps, out=h_buf, residual=pending)
            q, k, v = self.qkv(h, layer)
            ops.rms_norm(q, layer.attn_q_norm, c.norm_eps, out=q)
            ops.rms_norm(k, layer.attn_k_norm, c.norm_eps, out=k)
            q, k, v = self.rope_store(q, k, v, cache[i], meta, self.rope_local if sliding else self.rope_global)
            a = self.attend(q, k, v, cache[i], meta, layer, window=c.sliding_window if sliding else 0)
            ops.rms_norm(a, layer.post_attention_norm, c.norm_eps, out=a)
            h = ops.rms_norm(x, layer.ffn_norm, c.norm_eps, out=h_buf, residual=a)
            f = self.ffn(h, layer, gelu=True)
            pending = ops.rms_norm(f, layer.post_ffw_norm, c.norm_eps, out=f)
        return self.logits(x, logit_rows, residual=pending)
