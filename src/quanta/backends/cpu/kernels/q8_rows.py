"""The frame of the fast-mode row dots: one pass over weight rows for a group of q8 activation rows.

A decode batch (or a speculative verify step) multiplies the same weights with a few activation rows. A pass
unpacks each weight block once and meets it with every row of its group (register blocking: each row keeps its
own accumulators), and the arithmetic of a row is the same whatever the group: a row's result is bit for bit
the one it gets alone (tests/backends/cpu/test_q8_rows.py).

Blocks go in pairs (2p, 2p+1) so that one <8 x i32> integer dot holds both: its lanes 0-3 are block 2p's, 4-7
block 2p+1's, each lane summing 4 weights of the first half of its block (vector ``a``) and 4 of the second
(vector ``b``), so that one conversion and one FMA per row serve two blocks. Activation layout
(``activations.gemv_activations``):
- ``xq`` (n, 64 * pairs) int8: per pair ``x[2p][0:16], x[2p+1][0:16], x[2p][16:32], x[2p+1][16:32]`` (an odd
  last block is paired with zeros);
- ``xd``, ``xsum`` (groups, pairs, 8) float32: per group of 4 rows (``ROWS_PER_PASS``) and pair, the scale
  (and ``scale * sum(codes)``) of block 2p of the 4 rows, then of block 2p+1 (one load per pair and group; a pass
  of the legacy formats takes two groups, ``LEGACY_ROWS_PER_PASS``: their pair vectors side by side, ``pair_lane``);
- ``xstart`` (n, pairs, 8) int32: the integer dots' starting values (the code offsets of the weights).
The K-quants' row dots take one activation scale per 256 instead (``activations.superblock_activations``): codes
in their natural order, and per super-block a scale per row, 8 sums per 32 and 16 integer sums per 16 in the same
arrays (``ActRows.superblock_*``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from quanta.backends.cpu.kernels.isa import isa_of
from quanta.backends.cpu.kernels.simd import F32, I8, I16, I32, data_ptr, load_vec, vec

ROWS_PER_PASS = 4  # activation rows per pass at most (a variant of the pass is compiled for each count), and per
# group of the scales' layout
LEGACY_ROWS_PER_PASS = 8  # the legacy formats' passes: one accumulator per row leaves room for two groups


def pair_lane(t: int, block: int, rows: int) -> int:
    """The lane of row ``t``'s value for block 2p + ``block`` in a pass's pair vector (``ActRows.scales``) of
    ``rows`` rows: ``block * rows + t`` within one group, ``8 * (t // 4) + 4 * block + t % 4`` over two."""
    return block * rows + t if rows <= ROWS_PER_PASS else 2 * ROWS_PER_PASS * (t // 4) + 4 * block + t % 4


def pair_lanes(rows: int) -> int:
    """The lanes of a pass's pair vector of ``rows`` rows."""
    return 2 * rows if rows <= ROWS_PER_PASS else 4 * ROWS_PER_PASS


class ActRows:
    """A pass's activation rows as a row body sees them (layout in the module docstring)."""

    def __init__(self, builder, codes, starts, xd, xsum, pairs):
        self.builder, self._codes, self._starts, self._xd, self._xsum = builder, codes, starts, xd, xsum
        self._pairs = pairs

    def __len__(self) -> int:
        return len(self._codes)

    def codes(self, t: int, p):
        """Row ``t``'s activation vectors (a, b) of block pair ``p``, <32 x i8> each."""
        off = self.builder.mul(p, ir.Constant(p.type, 64))
        return tuple(load_vec(self.builder, self._codes[t], self.builder.add(off, ir.Constant(p.type, h)), I8, 32)
                     for h in (0, 32))

    def start(self, t: int, p):
        """Row ``t``'s <8 x i32> starting value of pair ``p``'s dot."""
        return load_vec(self.builder, self._starts[t], self.builder.mul(p, ir.Constant(p.type, 8)), I32, 8)

    def scales(self, p):
        """<pair_lanes(rows) x float>: the activation scales of blocks 2p and 2p+1 of each row (``pair_lane``)."""
        return self._pair(self._xd, p)

    def sums(self, p):
        """<pair_lanes(rows) x float>: ``scale * sum(codes)`` of blocks 2p and 2p+1 of each row (``pair_lane``)."""
        return self._pair(self._xsum, p)

    def superblock_scales(self, s):
        """<rows x float>: each row's activation scale of super-block ``s`` (K-quant layout)."""
        b, n = self.builder, len(self)
        v = load_vec(b, self._xd, b.mul(s, ir.Constant(s.type, 2 * ROWS_PER_PASS)), F32, ROWS_PER_PASS)
        return v if n == ROWS_PER_PASS else b.shuffle_vector(v, v, ir.Constant(vec(I32, n), list(range(n))))

    def superblock_sums(self, t: int, s):
        """<8 x float>: row ``t``'s ``scale * sum(codes)`` of each 32 of super-block ``s`` (K-quant layout)."""
        b = self.builder
        row = b.mul(ir.Constant(s.type, 2 * t), self._pairs)
        return load_vec(b, self._xsum, b.add(row, b.mul(s, ir.Constant(s.type, 8))), F32, 8)

    def superblock_sums16(self, t: int, s):
        """<16 x i16>: row ``t``'s integer sums of each 16 codes of super-block ``s`` (K-quant layout)."""
        b = self.builder
        return load_vec(b, b.bitcast(self._starts[t], I16.as_pointer()), b.mul(s, ir.Constant(s.type, 16)), I16, 16)

    def _pair(self, base, p):
        b, n, width = self.builder, len(self), 2 * ROWS_PER_PASS
        v = load_vec(b, base, b.mul(p, ir.Constant(p.type, width)), F32, width)
        if n == ROWS_PER_PASS:
            return v
        if n > ROWS_PER_PASS:  # the second group's vector beside the first's
            w = load_vec(b, base, b.add(b.mul(self._pairs, ir.Constant(p.type, width)),
                                        b.mul(p, ir.Constant(p.type, width))), F32, width)
            return b.shuffle_vector(v, w, ir.Constant(vec(I32, 2 * width), list(range(2 * width))))
        first = [*range(n), *range(ROWS_PER_PASS, ROWS_PER_PASS + n)]
        return b.shuffle_vector(v, v, ir.Constant(vec(I32, 2 * n), first))


def pair_pattern(first: int, second: int, rows: int) -> list[int]:
    """Shuffle indices of a pair vector of ``rows`` rows: ``first`` in block 2p's lanes, ``second`` in 2p+1's."""
    pattern = [first] * pair_lanes(rows)
    for t in range(rows):
        pattern[pair_lane(t, 1, rows)] = second
    return pattern


def row_lanes(builder, v, t: int, rows: int):
    """<8 x float> of row ``t`` from a pair vector: block 2p's value in lanes 0-3, 2p+1's in 4-7."""
    lanes = [pair_lane(t, 0, rows)] * 4 + [pair_lane(t, 1, rows)] * 4
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, 8), lanes))


def row_sum(builder, v, t: int, rows: int):
    """Row ``t``'s two lanes of a pair vector, added."""
    first, second = (builder.extract_element(v, ir.Constant(I32, pair_lane(t, j, rows))) for j in (0, 1))
    return builder.fadd(first, second)


def for_pairs(builder, nb, pair) -> None:
    """``pair(p, single)`` for the block pairs of ``nb`` blocks, two per iteration, then a last full pair and an odd
    last block (``single``)."""
    two = ir.Constant(nb.type, 2)
    pairs = builder.sdiv(nb, two)
    twice = builder.sdiv(pairs, two)
    with cgutils.for_range(builder, twice) as loop:
        p0 = builder.mul(loop.index, two)
        pair(p0, False)
        pair(builder.add(p0, ir.Constant(nb.type, 1)), False)
    with builder.if_then(builder.icmp_signed("!=", builder.mul(twice, two), pairs)):
        pair(builder.sub(pairs, ir.Constant(nb.type, 1)), False)
    with builder.if_then(builder.icmp_signed("!=", builder.mul(pairs, two), nb)):
        pair(pairs, True)


def rows_dot_q8_intrinsic(name: str, row_body, block_size: int, type_size: int, max_rows: int = ROWS_PER_PASS):
    """An intrinsic ``f(isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g)`` doing ``out[t, r] = dot(weight row
    r, activation row t)`` for r in [r0, r1) and the ``g <= max_rows`` rows t = t0..t0+g-1, in the
    instruction set of ``isa``'s type (``isa.token``).

    ``row_body(isa_name, builder, bp, rows, nb32)`` emits one weight row (bytes at ``bp``, ``nb32`` blocks of 32)
    against ``rows`` (an ``ActRows``) and returns one float per row; each row's arithmetic must not depend on the
    others'. ``t0`` is a multiple of ``ROWS_PER_PASS``.
    """

    def typer(typingctx, isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g):
        return types.none(isa, raw2d, r0, r1, xq, xd, xsum, xstart, out, t0, g), codegen

    def codegen(context, builder, signature, args):
        sig_args, isa = signature.args, isa_of(signature.args[0])
        base, qp, dp, sp, xsp, op = (data_ptr(context, builder, sig_args[j], args[j]) for j in (1, 4, 5, 6, 7, 8))
        row_bytes, row_codes, pairs, m = (cgutils.unpack_tuple(
            builder, context.make_array(sig_args[j])(context, builder, args[j]).shape)[1] for j in (1, 4, 7, 8))

        def c(v: int):
            return ir.Constant(m.type, v)

        nb32 = builder.sdiv(builder.mul(builder.sdiv(row_bytes, c(type_size)), c(block_size)), c(32))
        r0, r1, t0, g = (context.cast(builder, args[j], sig_args[j], types.intp) for j in (2, 3, 9, 10))

        def emit(rows: int) -> None:  # the pass for groups of ``rows`` rows
            ts = [builder.add(t0, c(t)) for t in range(rows)]
            acts = ActRows(builder, [builder.gep(qp, [builder.mul(t, row_codes)]) for t in ts],
                           [builder.gep(xsp, [builder.mul(t, builder.mul(pairs, c(8)))]) for t in ts],
                           *(builder.gep(ptr, [builder.mul(t0, builder.mul(pairs, c(2)))]) for ptr in (dp, sp)), pairs)
            with cgutils.for_range_slice(builder, r0, r1, c(1)) as (r, _):
                bp = builder.gep(base, [builder.mul(r, row_bytes)])
                for t, value in enumerate(row_body(isa, builder, bp, acts, nb32)):
                    builder.store(value, builder.gep(op, [builder.add(builder.mul(ts[t], m), r)]))

        def dispatch(rows: int) -> None:
            if rows == max_rows:
                emit(rows)
                return
            with builder.if_else(builder.icmp_signed("==", g, c(rows))) as (then, otherwise):
                with then:
                    emit(rows)
                with otherwise:
                    dispatch(rows + 1)

        dispatch(1)
        return context.get_dummy_value()

    typer.__name__ = name
    return intrinsic(typer)
