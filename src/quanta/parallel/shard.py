"""Which part of each tensor one rank of a tensor-parallel group holds (Megatron's split, on quantized blocks).

Query heads and key/value heads are split evenly (each rank attends with its heads over its heads' KV cache);
``attn_q/k/v`` by rows (output features) and ``attn_output`` by columns (its input features, the heads);
``ffn_gate``/``ffn_up`` by rows and ``ffn_down`` by columns over the same range of the FFN width; the lm head by
rows (vocabulary). The embedding table stays whole on every rank: a lookup reads only the batch's rows, so a
split would save memory but no bandwidth and cost one more collective per forward. Everything else (norms) is
replicated.

Quantized rows split only between whole blocks (32 weights, or a 256-weight super-block for the K-quants), so
a column split must fall on a block boundary of that matrix's format. The head counts must divide by the group
size; the FFN width need not: it is split into whole blocks of ``ffn_down``'s format as evenly as they go (the
7B's 11,008 = 43 super-blocks gives ranks of 22 and 21 at TP=2); the vocabulary is split in rows as evenly as
they go. A shape that cannot be split so is a clear error naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from quanta.errors import QuantaError
from quanta.gguf import TensorInfo
from quanta.models.config import ModelConfig
from quanta.quant.formats import get_format

_LAYER_TENSOR = re.compile(r"blk\.\d+\.(\w+)\.(weight|bias)$")


def even_range(n: int, parts: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s share of ``n`` items split into ``parts`` runs of whole ``unit``s, as even as they go (the
    first ranks take one unit more); ``n`` must be a multiple of ``unit``."""
    units = n // unit
    base, extra = divmod(units, parts)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world``: its ranges of query heads, key/value heads, FFN width and vocabulary."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    n_vocab: int
    head_dim: int

    @staticmethod
    def build(config: ModelConfig, tensors: dict[str, TensorInfo], rank: int, world: int) -> ShardPlan:
        """The plan of ``rank``; a QuantaError when the model's shapes do not split over ``world`` ranks."""
        c = config
        for what, n in (("attention heads", c.n_heads), ("key/value heads", c.n_kv_heads)):
            if n % world:
                raise QuantaError(f"tensor parallelism over {world} GPUs needs the {what} ({n}) to divide by {world}")
        down = tensors["blk.0.ffn_down.weight"]
        unit = get_format(down.type, down.name).block_size
        if c.d_ff // unit < world:
            raise QuantaError(f"the FFN width {c.d_ff} is {c.d_ff // unit} blocks of {down.type}, fewer than the "
                              f"{world} ranks of tensor parallelism")
        lm_head = tensors.get("output.weight", tensors["token_embd.weight"])
        n_vocab = lm_head.shape[0]
        plan = ShardPlan(rank, world, even_range(c.n_heads, world, rank), even_range(c.n_kv_heads, world, rank),
                         even_range(c.d_ff, world, rank, unit), even_range(n_vocab, world, rank), n_vocab, c.head_dim)
        for name, t in tensors.items():
            m = _LAYER_TENSOR.match(name)
            if m and m.group(1) == "attn_output":
                plan._columns(t, plan._span(plan.heads))  # raises where the heads' columns split a block
        return plan

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and FFN width (what its forward and its KV cache see)."""
        return replace(config, n_heads=self._count(self.heads), n_kv_heads=self._count(self.kv_heads),
                       d_ff=self._count(self.ffn))

    def tensor(self, t: TensorInfo) -> TensorInfo:
        """This rank's part of ``t`` (a view of the file for a row split, a host copy for a column split)."""
        m = _LAYER_TENSOR.match(t.name)
        kind = m.group(1) if m else t.name.split(".")[0]
        if kind == "attn_q":
            return self._rows(t, self._span(self.heads))
        if kind in ("attn_k", "attn_v"):
            return self._rows(t, self._span(self.kv_heads))
        if kind in ("ffn_gate", "ffn_up"):
            return self._rows(t, self.ffn)
        if kind == "attn_output":
            return self._columns(t, self._span(self.heads))
        if kind == "ffn_down":
            return self._columns(t, self.ffn)
        return t

    def lm_head(self, t: TensorInfo) -> TensorInfo:
        """This rank's vocabulary rows of the lm head (``output.weight``, or the tied embedding)."""
        return self._rows(t, self.vocab)

    @staticmethod
    def _count(span: tuple[int, int]) -> int:
        return span[1] - span[0]

    def _span(self, heads: tuple[int, int]) -> tuple[int, int]:
        return heads[0] * self.head_dim, heads[1] * self.head_dim

    @staticmethod
    def _rows(t: TensorInfo, span: tuple[int, int]) -> TensorInfo:
        start, stop = span
        rows = t.shape[0]
        per_row = t.nbytes // rows
        raw = t.raw.reshape(-1)[start * per_row:stop * per_row]
        shape = (stop - start, *t.shape[1:])
        return TensorInfo(t.name, t.type, shape, t.offset + start * per_row, raw.nbytes, raw)

    @staticmethod
    def _columns(t: TensorInfo, span: tuple[int, int]) -> TensorInfo:
        start, stop = span
        fmt = get_format(t.type, t.name)
        if start % fmt.block_size or stop % fmt.block_size:
            raise QuantaError(f"tensor {t.name} ({t.type}, blocks of {fmt.block_size}) cannot be split at columns "
                              f"{start}..{stop} for tensor parallelism: a split must fall between whole blocks")
        rows, cols = t.shape
        per_row = cols // fmt.block_size * fmt.type_size
        a, b = start // fmt.block_size * fmt.type_size, stop // fmt.block_size * fmt.type_size
        raw = np.ascontiguousarray(t.raw.reshape(rows, per_row)[:, a:b]).reshape(-1)
        return TensorInfo(t.name, t.type, (rows, stop - start), t.offset, raw.nbytes, raw)
