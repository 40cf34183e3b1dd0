"""numba kernels behind ``quanta.backends.cpu.qmatmul``: SIMD intrinsics per format family, parallel drivers.

numba keys its on-disk cache (``cache=True``) on the source file of the jitted function only (``rows.py``), but
the kernels inline intrinsics from the sibling modules and layout constants from ``quanta.quant.formats``. A
fingerprint of those sources is kept beside the cache; when it changes the stale cache entries are dropped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def _drop_stale_numba_cache() -> None:
    here = Path(__file__).parent
    sources = [*sorted(here.glob("*.py")), here.parents[2] / "quant" / "formats.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "kernels-sources.sha256"
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        for entry in cache.glob("*.nb[ic]"):
            entry.unlink()
        stamp.write_text(digest)
    except OSError:
        pass  # read-only install: numba then caches in its user-wide directory, keyed as usual


_drop_stale_numba_cache()
