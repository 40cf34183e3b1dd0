"""Competing load for `quanta bench --busy-cores N`: N processes that each keep one core busy for the whole run.

A laptop with a browser open, or a CI runner shared with other jobs, rarely gives an engine all its cores; how
decode degrades then (issue 32: two threads at 0.4 tok/s where one gave 28) is measured by starting the
competitor inside the bench, so that both engines see the same load, run by run. Each process is a pure-Python
busy loop at the bench's own priority (no affinity: the kernel places it, as it would a browser).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "import sys; sys.stdout.write('busy\\n'); sys.stdout.flush()\nwhile True: pass"


@contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
    """Run ``n`` busy-looping processes for the duration of the block; yields their process ids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for p in procs:  # each is spinning once it has said so
            assert p.stdout is not None
            if p.stdout.readline().strip() != "busy":
                raise RuntimeError("a --busy-cores process did not start")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
