"""Qwen2 / Qwen2.5: the llama layer with biases on Q, K and V and NEOX rope (rotates the two halves)."""

from __future__ import annotations

from types import SimpleNamespace

from quanta.models.llama import Llama


class Qwen2(Llama):
    arch = "qwen2"
    neox_rope = True

    def load_layer(self, i: int) -> SimpleNamespace:
        layer = super().load_layer(i)
        layer.bq = self.vector(f"blk.{i}.attn_q.bias")
        layer.bk = self.vector(f"blk.{i}.attn_k.bias")
        layer.bv = self.vector(f"blk.{i}.attn_v.bias")
        return layer
