"""Property-based validation: mutated real headers either open or raise GGUFError with a byte offset.

The files are miniatures of both real models (their metadata and tensor table, small tensors). gguf-py's reader
(an independent parser) locates every field, so mutations hit each kind of boundary: counts, string lengths,
value types, array lengths, dimensions, ggml types, tensor offsets and the alignment key.
"""

from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quanta.gguf import GGML_TYPES_BY_NAME, GGUFError, TensorToWrite, open_gguf, write_gguf

ABSURD = (0, 1, 3, 255, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1)


def write_miniature(real: Path, out: Path, *, max_array: int = 48, max_tensors: int = 64, seed: int = 0) -> Path:
    """A real model's metadata (long arrays cut to ``max_array`` entries) and its first tensors (same names,
    types and ranks, one block per row, two rows) with random bytes: a realistic header of a few tens of KB."""
    rng = np.random.default_rng(seed)
    with open_gguf(real) as f:
        metadata = {k: (v[:max_array] if isinstance(v, (list, np.ndarray)) else v) for k, v in f.metadata.items()}
        types = dict(f.metadata_types)
        tensors = []
        for t in list(f.tensors.values())[:max_tensors]:
            bs = GGML_TYPES_BY_NAME[t.type].block_size
            shape = (bs,) if len(t.shape) == 1 else (2,) * (len(t.shape) - 1) + (bs,)
            n = int(np.prod(shape)) // bs * GGML_TYPES_BY_NAME[t.type].type_size
            tensors.append(TensorToWrite(t.name, t.type, shape, rng.integers(0, 256, n, dtype=np.uint8)))
    write_gguf(out, metadata, tensors, metadata_types=types)
    return out


class Sample:
    """One valid miniature: its bytes and the (offset, size) of every numeric field gguf-py found."""

    def __init__(self, path: Path):
        self.blob = path.read_bytes()
        ref = gguf.GGUFReader(path)
        base = ref.data.ctypes.data
        fields = [*ref.fields.values(), *(t.field for t in ref.tensors)]
        parts = [(p.ctypes.data - base, p.nbytes, p.dtype.itemsize, p.size) for f in fields for p in f.parts]
        self.boundaries = sorted({b for off, n, _, _ in parts for b in (off, off + n)})
        self.numbers = sorted({(off, item) for off, n, item, size in parts if size == 1 and item in (4, 8)})
        self.data_offset = ref.data_offset


@pytest.fixture(scope="module")
def samples(tmp_path_factory, smollm2_path, gemma3_path) -> list[Sample]:
    d = tmp_path_factory.mktemp("mini")
    out = []
    for i, real in enumerate((smollm2_path, gemma3_path)):
        mini = write_miniature(real, d / f"mini{i}.gguf", max_tensors=40, seed=i)
        out.append(Sample(mini))
    aligned = d / "aligned.gguf"  # same as the first, with an explicit general.alignment key
    with open_gguf(d / "mini0.gguf") as f:
        write_gguf(aligned, f.metadata, [TensorToWrite(t.name, t.type, t.shape, t.raw.copy()) for t in f.tensors.values()],
                   metadata_types=f.metadata_types, alignment=64)
    out.append(Sample(aligned))
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "case.gguf"


def rewrite(path: Path, blob: bytes) -> None:
    """The file's bytes replaced in place: emptying a file and growing it again (``write_bytes``) costs ~2.5 ms on
    an ext4 disk, most of a case."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, blob, 0)
        os.ftruncate(fd, len(blob))
    finally:
        os.close(fd)


def check(path: Path, blob: bytes) -> bool:
    """Open a mutated file: fine (every tensor readable, every value typed) or GGUFError with an offset; True if
    it opened."""
    rewrite(path, blob)
    try:
        with open_gguf(path) as f:
            for t in f.tensors.values():
                assert t.offset + t.nbytes <= len(blob) and t.raw.nbytes == t.nbytes
                t.raw[-1:].sum()
            assert f.metadata.keys() == f.metadata_types.keys()  # every value parsed, with its type
        return True
    except GGUFError as e:
        assert e.offset is not None and f"at byte {e.offset}" in str(e), str(e)
        assert 0 <= e.offset <= max(len(blob), 1 << 65)
        return False


def test_truncation_at_every_field_boundary(samples, scratch):
    cases = 0
    for s in samples:
        for b in s.boundaries:
            for cut in (b - 1, b, b + 1):
                if 0 <= cut < len(s.blob):
                    opened = check(scratch, s.blob[:cut])
                    assert not opened or cut >= s.data_offset
                    cases += 1
    print(f"\n{cases} truncations")
    assert cases > 1000


def test_absurd_values_in_every_numeric_field(samples, scratch):
    cases = 0
    for s in samples:
        for off, size in s.numbers:
            old = int.from_bytes(s.blob[off : off + size], "little")
            for v in (*ABSURD, old + 1, old - 1, len(s.blob), len(s.blob) - off):
                if 0 <= v < 256**size:
                    blob = bytearray(s.blob)
                    blob[off : off + size] = v.to_bytes(size, "little")
                    check(scratch, bytes(blob))
                    cases += 1
    print(f"\n{cases} absurd values")
    assert cases > 2000


@settings(max_examples=1500, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_byte_flips_and_truncations(samples, scratch, data):
    s = data.draw(st.sampled_from(samples))
    blob = bytearray(s.blob)
    header_end = s.data_offset + 64  # mutations past the tensor table only change tensor bytes
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, header_end - 1) | st.sampled_from(s.boundaries[:-1]))
        blob[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del blob[data.draw(st.integers(0, len(blob))):]
    check(scratch, bytes(blob))


def test_memory_stays_within_the_file_size(samples, scratch):
    """A sample of absurd counts, lengths and dims: the parser's peak allocation stays proportional to the file."""
    rng = np.random.default_rng(0)
    for s in samples:
        picks = rng.choice(len(s.numbers), size=min(60, len(s.numbers)), replace=False)
        for i in picks:
            off, size = s.numbers[i]
            blob = bytearray(s.blob)
            blob[off : off + size] = (2**(8 * size) - 1 - int(rng.integers(0, 2**20))).to_bytes(size, "little")
            rewrite(scratch, bytes(blob))
            tracemalloc.start()
            try:
                with open_gguf(scratch):
                    pass
            except GGUFError:
                pass
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < 16 * len(blob) + (1 << 20), (off, peak)


def test_alignment_key_values(samples, scratch):
    s = samples[-1]
    key = b"general.alignment"
    at = s.blob.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    for v in (0, 1, 2, 16, 31, 48, 64, 2**20, 2**31, 2**32 - 1):
        blob = bytearray(s.blob)
        blob[at : at + 4] = struct.pack("<I", v)
        rewrite(scratch, bytes(blob))
        if v == 64:
            assert check(scratch, bytes(blob))
            continue
        with pytest.raises(GGUFError) as e:
            open_gguf(scratch)
        if not (0 < v <= 2**30 and v & (v - 1) == 0):
            assert "general.alignment" in str(e.value), v
        else:  # a valid alignment, but the data was laid out for 64: gaps (1, 2, 16), data past the end (2**20)
            assert "expected offset" in str(e.value) or "past the end" in str(e.value), (v, str(e.value))

