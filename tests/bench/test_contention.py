"""`quanta bench --busy-cores`: the competing processes really use a core each, and are gone afterwards."""

from __future__ import annotations

import os
import time

import pytest

from quanta.bench.contention import busy_cores

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (utime and stime are fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_each_busy_process_burns_cpu_and_is_reaped():
    with busy_cores(2) as pids:
        assert len(set(pids)) == 2
        before = [cpu_seconds(p) for p in pids]
        time.sleep(2.0)
        used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
    # a sleeping process shows 0 clock ticks; a busy one some, however loaded the machine (seen: 3% of a core)
    assert all(u > 0 for u in used), used
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)  # killed and reaped


def test_zero_busy_cores_starts_nothing():
    with busy_cores(0) as pids:
        assert pids == []
