"""Each named validation error, on files assembled byte by byte here (independent of our writer)."""

from __future__ import annotations

import struct

import pytest

from quanta.gguf import GGUFError, open_gguf


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv_u32(key: bytes, v: int) -> bytes:
    return _str(key) + struct.pack("<II", 4, v)


def _tensor_info(name=b"w", ne=(32, 2), type_id=0, offset=0) -> bytes:
    return _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", type_id, offset)


def build(*, magic=b"GGUF", version=3, kvs=(_kv_u32(b"a.b", 7),), infos=(_tensor_info(),), n_kv=None,
          n_tensors=None, data=None, alignment=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + (bytes(range(256)) if data is None else data)


def expect(tmp_path, blob: bytes, match: str, offset: int | None = None) -> GGUFError:
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(GGUFError, match=match) as e:
        open_gguf(path)
    if offset is not None:
        assert e.value.offset == offset and f"at byte {offset}" in str(e.value)
    return e.value


def test_the_valid_base_file_opens(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(build())
    with open_gguf(path) as f:
        assert f.metadata == {"a.b": 7}
        assert f.tensors["w"].shape == (2, 32) and f.tensors["w"].nbytes == 256


def test_bad_magic(tmp_path):
    expect(tmp_path, build(magic=b"GGML"), "bad magic", 0)


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    e = expect(tmp_path, build(version=version), "unsupported GGUF version", 4)
    if version > 0xFFFF:
        assert "big-endian" in str(e)


def test_version_2_is_read(tmp_path):
    path = tmp_path / "v2.gguf"
    path.write_bytes(build(version=2))
    with open_gguf(path) as f:
        assert f.version == 2


@pytest.mark.parametrize("size", [0, 3, 10, 23])
def test_truncated_header(tmp_path, size):
    expect(tmp_path, build()[:size], "too small|truncated")


def test_truncated_metadata(tmp_path):
    blob = build()
    expect(tmp_path, blob[: 24 + 8 + 3 + 2], "truncated type of a.b|truncated")  # inside the key's type field
    key_end = 24 + 8 + 3 + 4
    expect(tmp_path, build(kvs=(_str(b"a.b") + struct.pack("<I", 4) + b"\x01",), infos=())[: key_end + 1],
           "truncated a.b", key_end)


def test_truncated_tensor_table(tmp_path):
    start = 24 + len(_kv_u32(b"a.b", 7))
    e = expect(tmp_path, build()[: start + 8 + 1 + 4 + 5], "truncated shape of w")
    assert e.offset == start + 13


def test_truncated_data(tmp_path):
    expect(tmp_path, build()[:-1], "runs past the end of the file")


def test_tensor_out_of_bounds(tmp_path):
    expect(tmp_path, build(infos=(_tensor_info(offset=64),)), "runs past the end")
    expect(tmp_path, build(infos=(_tensor_info(offset=2**64 - 32),)), "runs past the end")


def test_misaligned_tensor(tmp_path):
    expect(tmp_path, build(infos=(_tensor_info(offset=4),), data=bytes(512)), "not aligned to 32")


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**31])
def test_bad_alignment(tmp_path, alignment):
    expect(tmp_path, build(kvs=(_kv_u32(b"general.alignment", alignment),)), "general.alignment", 24)


def test_unknown_ggml_type(tmp_path):
    start = 24 + len(_kv_u32(b"a.b", 7))
    expect(tmp_path, build(infos=(_tensor_info(type_id=4),)), "unknown ggml type 4", start + 8 + 1 + 4 + 16)
    expect(tmp_path, build(infos=(_tensor_info(type_id=2**32 - 1),)), "unknown ggml type")


@pytest.mark.parametrize("ne", [(2**63, 2**63), (2**32, 2**32, 2**32), (0, 4), (32,) * 5, ()])
def test_overflowing_or_invalid_dims(tmp_path, ne):
    expect(tmp_path, build(infos=(_tensor_info(ne=ne),)), "dimension|overflows|dimensions")


def test_row_not_multiple_of_block(tmp_path):
    expect(tmp_path, build(infos=(_tensor_info(ne=(33, 1), type_id=8),)), "not a multiple")


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
def test_huge_counts(tmp_path, field):
    e = expect(tmp_path, build(**{field: 2**63}), "count .* larger than the file")
    assert e.offset in (8, 16)


def test_huge_string_length(tmp_path):
    kv = struct.pack("<Q", 2**64 - 1) + b"abc"
    expect(tmp_path, build(kvs=(kv,)), "metadata key length .* exceeds", 24)
    kv = _str(b"k") + struct.pack("<IQ", 8, 2**40) + b"x"
    expect(tmp_path, build(kvs=(kv,)), "k length .* exceeds", 24 + 9 + 4)


def test_huge_array_counts(tmp_path):
    for etype in (0, 4, 8, 9, 12):
        kv = _str(b"k") + struct.pack("<IIQ", 9, etype, 2**62)
        expect(tmp_path, build(kvs=(kv,)), "claims", 24 + 9 + 4)


def test_unknown_value_types(tmp_path):
    expect(tmp_path, build(kvs=(_str(b"k") + struct.pack("<I", 13),)), "unknown metadata value type 13")
    expect(tmp_path, build(kvs=(_str(b"k") + struct.pack("<IIQ", 9, 77, 1),)), "unknown array element type 77")


def test_arrays_nested_too_deep(tmp_path):
    kv = _str(b"k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20 + struct.pack("<IQ", 4, 0)
    expect(tmp_path, build(kvs=(kv,)), "nested deeper")


def test_duplicates(tmp_path):
    expect(tmp_path, build(kvs=(_kv_u32(b"a", 1), _kv_u32(b"a", 2))), "duplicate metadata key a")
    expect(tmp_path, build(infos=(_tensor_info(), _tensor_info())), "duplicate tensor name w")


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        open_gguf(tmp_path)
    with pytest.raises(GGUFError, match="cannot open"):
        open_gguf(tmp_path / "missing.gguf")


def _two_tensors(offset_a: int, offset_b: int) -> bytes:
    """Tensors a and b of 256 bytes each (F32 32x2) at the given data offsets; 512 data bytes."""
    infos = (_tensor_info(b"a", offset=offset_a), _tensor_info(b"b", offset=offset_b))
    return build(infos=infos, data=bytes(512))


def test_tensor_data_laid_out_in_table_order_opens(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_two_tensors(0, 256))
    with open_gguf(path) as f:
        assert f.tensors["b"].offset - f.tensors["a"].offset == 256


@pytest.mark.parametrize("offsets, what", [
    ((0, 0), "overlaps"),  # b's data is a's
    ((0, 128), "overlaps"),  # b starts inside a
    ((256, 0), "gap"),  # out of order: a after b (llama.cpp: "has offset 256, expected 0")
    ((0, 288), "gap"),  # aligned, inside the file, but not where a ends
])
def test_overlapping_or_out_of_order_data_is_refused(tmp_path, offsets, what):
    start_b = 24 + len(_kv_u32(b"a.b", 7)) + len(_tensor_info(b"a"))
    blob = _two_tensors(*offsets)
    if offsets == (0, 288):
        blob += bytes(64)  # b then ends inside the file
    e = expect(tmp_path, blob, what)
    assert "expected offset" in str(e)
    if offsets[0] == 0:
        assert e.offset == start_b and "tensor b" in str(e)


def test_gguf_error_is_a_quanta_error():
    from quanta.errors import QuantaError

    assert issubclass(GGUFError, QuantaError) and issubclass(GGUFError, ValueError)
