"""Our reader against gguf-py's GGUFReader (the independent oracle) on both real models, and open-time speed."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from quanta.gguf import open_gguf


@pytest.fixture(scope="module")
def gguf_py(smollm2_path, gemma3_path):
    """gguf-py's view of both models, and the seconds it took to open them (read once: it is slow)."""
    t0 = time.perf_counter()
    readers = {"smollm2": gguf.GGUFReader(smollm2_path), "gemma3": gguf.GGUFReader(gemma3_path)}
    for r in readers.values():
        assert r.tensors and r.fields
    return readers, time.perf_counter() - t0


def _same_value(ours, theirs) -> bool:
    if isinstance(ours, np.ndarray):
        ours = ours.tolist()
    return ours == theirs


def _type_code(t) -> int | tuple[int, ...]:
    return tuple(int(x) for x in t) if isinstance(t, tuple) else int(t)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_metadata_and_tensor_table_equal_gguf_py(model, gguf_py, smollm2_path, gemma3_path):
    ref = gguf_py[0][model]
    path = smollm2_path if model == "smollm2" else gemma3_path
    with open_gguf(path) as f:
        ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == ref_keys
        for key in ref_keys:
            field = ref.fields[key]
            assert _same_value(f.metadata[key], field.contents()), key
            expected = field.types[0] if len(field.types) == 1 else (field.types[0], field.types[-1])
            assert _type_code(f.metadata_types[key]) == _type_code(expected), key
        assert f.version == int(ref.fields["GGUF.version"].contents())
        assert [t.name for t in ref.tensors] == list(f.tensors)
        for t in ref.tensors:
            ours = f.tensors[t.name]
            assert ours.type == t.tensor_type.name
            assert ours.shape == tuple(int(d) for d in reversed(t.shape))
            assert ours.offset == t.data_offset
            assert ours.nbytes == t.n_bytes
            assert ours.raw.shape == (t.n_bytes,)
            assert np.array_equal(ours.raw[:64], t.data.reshape(-1).view(np.uint8)[:64])
            assert np.array_equal(ours.raw[-64:], t.data.reshape(-1).view(np.uint8)[-64:])


def test_raw_is_a_zero_copy_view(smollm2_path):
    with open_gguf(smollm2_path) as f:
        t = next(iter(f.tensors.values()))
        assert not t.raw.flags.owndata and not t.raw.flags.writeable


def test_open_is_at_least_5x_faster_than_gguf_py(gguf_py, smollm2_path, gemma3_path):
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for p in (smollm2_path, gemma3_path):
            with open_gguf(p) as f:
                assert f.metadata and f.tensors
        times.append(time.perf_counter() - t0)
    t_ours, t_theirs = min(times), gguf_py[1]
    ratio = t_theirs / t_ours
    print(f"\nopen both real models: quanta {t_ours * 1e3:.0f} ms, gguf-py {t_theirs * 1e3:.0f} ms, {ratio:.1f}x faster")
    assert ratio >= 5
