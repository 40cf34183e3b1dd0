"""Writer round trips: every value type through our reader and through gguf-py; gguf-py's files through ours."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from quanta.gguf import TensorToWrite, ValueType, open_gguf, typed, write_gguf

SCALARS = {
    "t.u8": typed(255, "UINT8"), "t.i8": typed(-128, "INT8"), "t.u16": typed(65535, "UINT16"),
    "t.i16": typed(-32768, "INT16"), "t.u32": typed(2**32 - 1, "UINT32"), "t.i32": typed(-(2**31), "INT32"),
    "t.f32": typed(0.5, "FLOAT32"), "t.bool": True, "t.false": False, "t.u64": typed(2**64 - 1, "UINT64"),
    "t.i64": typed(-(2**63), "INT64"), "t.f64": typed(1 / 3, "FLOAT64"), "t.str": "héllo ▁wörld 🦙 \u0000end",
    "t.empty": "",
}
ARRAYS = {
    "a.u8": typed([0, 1, 255], "UINT8"), "a.i8": typed([-1, 2], "INT8"), "a.i16": typed([-300, 300], "INT16"),
    "a.u64": typed([2**64 - 1, 0], "UINT64"), "a.f64": typed([1e300, -2.5], "FLOAT64"),
    "a.f32": [0.25, -1.5], "a.bool": [True, False, True], "a.i32": [-5, 7], "a.str": ["a", "", "ünï", "🦙"],
    "a.nested": [[1, 2, 3], [4], []], "a.nested_str": [["x", "yz"], ["é"]], "a.deep": [[[1], [2, 3]], [[4]]],
    "a.empty": [],
}


def _plain(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _tensors(rng):
    return [
        TensorToWrite("w.f32", "F32", (3, 5), rng.standard_normal((3, 5)).astype(np.float32)),
        TensorToWrite("w.f16", "F16", (7,), lambda: rng.standard_normal(7).astype(np.float16)),
        TensorToWrite("w.q8", "Q8_0", (2, 64), rng.integers(0, 256, 2 * 2 * 34, dtype=np.uint8).tobytes()),
        TensorToWrite("w.q4k", "Q4_K", (1, 2, 256), rng.integers(0, 256, 2 * 144, dtype=np.uint8)),
    ]


@pytest.mark.parametrize("alignment", [32, 1, 8, 64, 4096])
def test_round_trip_through_our_reader(tmp_path, alignment):
    tensors = _tensors(np.random.default_rng(alignment))
    expected_bytes = [np.frombuffer(memoryview(np.ascontiguousarray(t.data() if callable(t.data) else t.data)).cast("B"),
                                    np.uint8).copy() for t in _tensors(np.random.default_rng(alignment))]
    path = tmp_path / "x.gguf"
    write_gguf(path, {**SCALARS, **ARRAYS}, tensors, alignment=alignment)
    with open_gguf(path) as f:
        assert f.version == 3 and f.alignment == alignment
        for key, value in SCALARS.items():
            want = value.value if hasattr(value, "value") else value
            got = f.metadata[key]
            assert got == (np.float32(want) if key == "t.f32" else want), key
            assert f.metadata_types[key] == (value.type if hasattr(value, "type") else
                                             ValueType.BOOL if isinstance(value, bool) else ValueType.STRING)
        for key, value in ARRAYS.items():
            want = value.value if hasattr(value, "value") else value
            assert _plain(f.metadata[key]) == want, key
        assert f.metadata_types["a.u64"] == (ValueType.ARRAY, ValueType.UINT64)
        assert f.metadata_types["a.nested"] == (ValueType.ARRAY, ValueType.ARRAY)
        for t, want in zip(tensors, expected_bytes):
            info = f.tensors[t.name]
            assert info.type == t.type and info.shape == t.shape
            assert (info.offset - f.data_offset) % alignment == 0 and f.data_offset % alignment == 0
            assert np.array_equal(info.raw, want)


def test_round_trip_of_a_real_header_is_byte_identical(tmp_path, smollm2_path):
    """Rewriting a real model's metadata with the types the reader reports gives the same metadata bytes."""
    with open_gguf(smollm2_path) as f:
        tensors = [TensorToWrite(t.name, t.type, t.shape, t.raw) for t in f.tensors.values()]
        out = tmp_path / "copy.gguf"
        write_gguf(out, f.metadata, tensors, metadata_types=f.metadata_types)
    assert out.read_bytes() == smollm2_path.read_bytes()


@pytest.mark.parametrize("alignment", [32, 16, 128])
def test_our_files_open_in_gguf_py(tmp_path, alignment):
    path = tmp_path / "x.gguf"
    tensors = _tensors(np.random.default_rng(0))
    flat = {k: v for k, v in {**SCALARS, **ARRAYS}.items() if not k.startswith(("a.nested", "a.deep", "a.empty"))}
    write_gguf(path, flat, tensors, alignment=alignment)
    ref = gguf.GGUFReader(path)
    assert ref.alignment == alignment
    for key, value in flat.items():
        want = value.value if hasattr(value, "value") else value
        got = ref.fields[key].contents()
        if key in ("t.f32", "a.f32"):
            assert np.allclose(got, want)
        else:
            assert got == want, key
    with open_gguf(path) as f:
        for t in ref.tensors:
            ours = f.tensors[t.name]
            assert t.tensor_type.name == ours.type
            assert tuple(reversed([int(d) for d in t.shape])) == ours.shape
            assert t.data_offset == ours.offset
            assert np.array_equal(t.data.reshape(-1).view(np.uint8), ours.raw)


def test_gguf_py_files_open_in_ours(tmp_path):
    path = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int8("k.i8", -7)
    w.add_float64("k.f64", 2.75)
    w.add_bool("k.bool", True)
    w.add_string("k.s", "ñ🦙")
    w.add_array("k.arr", [[1, 2], [3]])
    w.add_array("k.strs", ["a", "bc"])
    data = np.arange(64, dtype=np.float32).reshape(2, 32)
    w.add_tensor("t", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_gguf(path) as f:
        assert f.metadata["general.architecture"] == "llama"
        assert f.metadata["k.u64"] == 2**63 + 5 and f.metadata["k.i8"] == -7 and f.metadata["k.f64"] == 2.75
        assert f.metadata["k.bool"] is True and f.metadata["k.s"] == "ñ🦙"
        assert _plain(f.metadata["k.arr"]) == [[1, 2], [3]] and f.metadata["k.strs"] == ["a", "bc"]
        t = f.tensors["t"]
        assert t.type == "F32" and t.shape == (2, 32)
        assert np.array_equal(t.raw.view(np.float32).reshape(2, 32), data)


def test_wrong_data_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs"):
        write_gguf(tmp_path / "x.gguf", {}, [TensorToWrite("t", "Q8_0", (1, 32), np.zeros(10, np.uint8))])
    assert not (tmp_path / "x.gguf").exists()
