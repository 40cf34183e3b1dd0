"""Copies of activations in the form the next matmul reads, written by the op that produces the activations.

Decode (up to ``INT8_MAX_ROWS`` rows: one sequence or a small decode batch): int8 with a scale per 32 values for
the int8 GEMV (q8gemv.py), one storage per float buffer. More rows (decode batches, prefill; fast
mode): bf16 in the GEMM's word order (gemm.py's ``word_order``), in one scratch shared by every activation, so in one
order: that of the 4-bit codes when most of the model's matrices hold
them, of the 8-bit codes when most hold those, else none (the matrices of another kind, and a matmul whose input
has no current copy, permute x themselves).

A copy is *live* from the op that wrote its float values until the next op that is not a matmul: producers (norms,
gated activations, attention) write theirs, and every other op drops them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quanta.backends.cuda.gemm import WordsCopy
from quanta.backends.cuda.q8gemv import Q8Activation, quantize
from quanta.backends.cuda.qmatmul import INT8_MAX_ROWS, GEMV_MAX_ROWS

_Key = tuple[int, tuple[int, ...]]


def _key(x: torch.Tensor) -> _Key:
    return x.data_ptr(), tuple(x.shape)


class ActivationCopies:
    """The copies of one backend. ``buffer(name, shape)``: the backend's float32 named buffers (whose storage
    graphs may capture)."""

    def __init__(self, device: torch.device, *, q8: bool, words: bool,
                 buffer: Callable[[str, tuple[int, ...]], torch.Tensor], pdl: bool = False):
        self.device = device
        self.pdl = pdl  # launch the quantizing kernel with PDL
        self.q8 = q8  # int8 copies for the decode GEMV
        self.words = words  # bf16 word-order copies for the prefill GEMM (also needs most weights of one kind)
        self._buffer = buffer
        self._q8: dict[_Key, Q8Activation] = {}
        self._live: set[_Key] = set()
        self._words_of: _Key | None = None  # the activation the word-order scratch holds
        self._kinds: dict[str, int] = {}  # the model's matrices per code kind (repack.py)

    def count_weight(self, kind: str) -> None:
        """A matrix of ``kind`` was loaded: word-order copies are made in the order of the kind most matrices
        hold."""
        self._kinds[kind] = self._kinds.get(kind, 0) + 1

    def _words_kind(self) -> str | None:
        """The code kind (q4 or q8) of more than half the model's matrices, whose word order the copies take."""
        total = sum(self._kinds.values())
        return next((k for k in ("q4", "q8") if self._kinds.get(k, 0) * 2 > total), None)

    def _fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[1] % 32 == 0 and x.is_contiguous()

    def q8_copy(self, x: torch.Tensor) -> Q8Activation | None:
        """The int8 storage paired with float activations ``x`` when they can feed the int8 GEMV, else None."""
        if not self.q8 or not self._fits(x) or x.shape[0] > INT8_MAX_ROWS:
            return None
        q = self._q8.get(_key(x))
        if q is None:
            q = self._q8[_key(x)] = Q8Activation.empty(*x.shape, self.device)
        return q

    def _words_scratch(self, x: torch.Tensor) -> WordsCopy | None:
        rows = x.shape[0]
        if not self.words or not self._fits(x) or rows <= GEMV_MAX_ROWS or (self.q8 and rows <= INT8_MAX_ROWS):
            return None  # these rows take a GEMV
        kind = self._words_kind()
        if kind is None:
            return None
        m, k = x.shape
        return WordsCopy(self._buffer("x_words", (m, k // 2)).view(torch.bfloat16), kind)

    def produce(self, out: torch.Tensor | None, *, q8: bool = True,
                words: bool = True) -> tuple[Q8Activation | None, WordsCopy | None]:
        """For an op about to write ``out`` (None: an op that writes no copy): every copy goes stale; returns the
        int8 and the word-order copy the op should write (None where it cannot: ``q8``/``words`` False)."""
        self._live.clear()
        self._words_of = None
        if out is None:
            return None, None
        q = self.q8_copy(out) if q8 else None
        w = self._words_scratch(out) if words else None
        if q is not None or w is not None:
            self._live.add(_key(out))
        if w is not None:
            self._words_of = _key(out)
        return q, w

    def matmul_input(self, x: torch.Tensor, outs: list[torch.Tensor], kind: str) -> tuple[Any, Any]:
        """A matmul's input copies against a ``kind`` weight: (int8 copy for the GEMV, quantized now if its
        producer wrote none; word-order copy for the GEMM or None). The matmul's outputs go stale."""
        q = self.q8_copy(x) if kind != "dense" else None
        if q is not None and _key(x) not in self._live:
            quantize(x, q, self.pdl)
            self._live.add(_key(x))
        w = None
        if self._words_of == _key(x) and kind == self._words_kind():
            w = self._words_scratch(x).data
        for o in outs:
            self._live.discard(_key(o))
            if self._words_of == _key(o):
                self._words_of = None
        return q, w
