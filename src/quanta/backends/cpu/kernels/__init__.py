"""numba kernels behind ``quanta.backends.cpu.qmatmul``: SIMD intrinsics per format family, parallel drivers.

numba keys its on-disk cache (``cache=True``) on the source file of the jitted function only (``rows.py``,
``attention.py``), but the kernels inline intrinsics from the sibling modules (``vector_rows``, ``key_runs``) and
layout constants from ``quanta.quant.formats``. A fingerprint of those sources and of the CPU backend's own jitted
modules is kept beside the cache; when it changes, the stale entries of both caches (this package's and the
backend's: ``attention.py`` and ``ops.py`` inline the intrinsics too) are dropped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def drop_stale_numba_cache(kernels: Path, backend: Path, formats: Path) -> bool:
    """Drop the numba cache entries of ``kernels`` and ``backend`` (their ``__pycache__``) when the fingerprint of
    their sources and ``formats`` changed since the last call; returns whether it dropped them."""
    sources = [*sorted(kernels.glob("*.py")), *sorted(backend.glob("*.py")), formats]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    cache = kernels / "__pycache__"
    stamp = cache / "kernels-sources.sha256"
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for entry in [*cache.glob("*.nb[ic]"), *(backend / "__pycache__").glob("*.nb[ic]")]:
            entry.unlink()
        stamp.write_text(digest)
    except OSError:
        return False  # read-only install: numba then caches in its user-wide directory, keyed as usual
    return True


_HERE = Path(__file__)
drop_stale_numba_cache(_HERE.parent, _HERE.parents[1], _HERE.parents[3] / "quant" / "formats.py")
