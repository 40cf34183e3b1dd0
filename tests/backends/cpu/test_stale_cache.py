"""The numba cache entries dropped when a kernel source changes: numba keys a cached function by its own file only,
so ``attention.py``'s kernels would keep the code of an intrinsic (``key_runs.py``) that changed since."""

from __future__ import annotations

from quanta.backends.cpu.kernels import drop_stale_numba_cache


def _tree(tmp_path):
    backend, kernels = tmp_path / "cpu", tmp_path / "cpu" / "kernels"
    for folder in (backend, kernels):
        (folder / "__pycache__").mkdir(parents=True)
    (kernels / "key_runs.py").write_text("A = 1\n")
    (backend / "attention.py").write_text("B = 1\n")
    formats = tmp_path / "formats.py"
    formats.write_text("C = 1\n")
    return backend, kernels, formats


def _cached(backend, kernels):
    entries = [backend / "__pycache__" / "attention.kernel-1.py311.nbi", kernels / "__pycache__" / "rows.x-2.nbc"]
    for entry in entries:
        entry.write_bytes(b"machine code")
    return entries


def test_a_changed_intrinsic_drops_the_backends_cached_kernels_too(tmp_path):
    backend, kernels, formats = _tree(tmp_path)
    assert drop_stale_numba_cache(kernels, backend, formats)  # no fingerprint yet
    entries = _cached(backend, kernels)
    assert not drop_stale_numba_cache(kernels, backend, formats)  # nothing changed: the cache stays
    assert all(e.exists() for e in entries)
    (kernels / "key_runs.py").write_text("A = 2\n")  # an intrinsic changed, not the file of the cached kernel
    assert drop_stale_numba_cache(kernels, backend, formats)
    assert not any(e.exists() for e in entries)
    assert (backend / "__pycache__").exists()  # only numba's entries go
    entries = _cached(backend, kernels)
    formats.write_text("C = 2\n")  # a block layout changed
    assert drop_stale_numba_cache(kernels, backend, formats)
    assert not any(e.exists() for e in entries)
