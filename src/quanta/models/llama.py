"""Llama family (TinyLlama, SmolLM2, Llama-2/3, Mistral): pre-norm, GQA, NORM rope, SiLU-gated FFN.

llama.cpp's converter permutes the Q/K rows so that rope rotates adjacent pairs (2i, 2i+1) on the GGUF
weights. Llama-3.x stores its rope scaling as per-frequency divisors in ``rope_freqs.weight``.
"""

from __future__ import annotations

from typing import Any

from quanta.backends.base import Array, AttentionMetadata
from quanta.models.base import Model, rope_inv_freq


class Llama(Model):
    arch = "llama"
    neox_rope = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        c = self.config
        factors = None
        if "rope_freqs.weight" in self.gguf.tensors:
            factors = self.backend.to_host(self.vector("rope_freqs.weight"))
        self.rope = self.backend.rope_table(rope_inv_freq(c.rope_base, c.rope_dim, c.rope_scale, factors), self.n_ctx)

    def forward(self, token_ids: Array, meta: AttentionMetadata, cache: Any, logit_rows: Array | None) -> Array:
        ops, c, n = self.backend, self.config, token_ids.shape[0]
        x = self.embed(token_ids)
        h_buf = ops.buffer("h", (n, c.d_model))
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, c.norm_eps, out=h_buf)
            q, k, v = self.qkv_rope(h, layer, cache[i], meta, self.rope)
            self.attend(q, k, v, cache[i], meta, layer, residual=x)
            h = ops.rms_norm(x, layer.ffn_norm, c.norm_eps, out=h_buf)
            self.ffn(h, layer, residual=x)
        return self.logits(x, logit_rows)
