"""Render hostile chat templates one at a time, each in a forked process with memory and CPU limits.

Run as ``python template_probe.py TIME_LIMIT < payloads.json``; prints one JSON line per payload: the exception
type and message (or ``null`` when it rendered), whether it is a ``ChatTemplateError``, the seconds from compiling
to the end of the render, and the peak resident memory of that process over its start (MiB). A payload that kills its process (or runs past the
hard limit) is reported as ``"crashed"`` / ``"timeout"``.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time

from quanta.tokenizer import ChatTemplateError
from quanta.tokenizer.chat_template import ChatTemplate

HARD_SECONDS = 30
EXTRA_ADDRESS_SPACE = 2 << 30  # bytes a payload may map beyond what the process holds at fork


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _render(source: str, time_limit: float) -> dict:
    start_rss, start = _rss_mib(), time.monotonic()
    try:
        ChatTemplate(source, time_limit=time_limit).render([{"role": "user", "content": "hello"}])
        error, message, clean = None, "", False
    except BaseException as e:  # noqa: BLE001 - reported, not handled
        error, message, clean = type(e).__name__, str(e)[:300], isinstance(e, ChatTemplateError)
    return {"error": error, "clean": clean, "message": message, "seconds": time.monotonic() - start,
            "rss_mib": _rss_mib() - start_rss}


def _probe(source: str, time_limit: float) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + EXTRA_ADDRESS_SPACE,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (HARD_SECONDS, HARD_SECONDS))
        os.write(write_fd, json.dumps(_render(source, time_limit)).encode())
        os._exit(0)
    os.close(write_fd)
    ready, _, _ = select.select([read_fd], [], [], HARD_SECONDS)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    data = b""
    while ready and (chunk := os.read(read_fd, 1 << 16)):
        data += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    if not ready:
        return {"error": "timeout", "clean": False, "message": "", "seconds": HARD_SECONDS, "rss_mib": 0.0}
    return json.loads(data) if data else {"error": "crashed", "clean": False, "message": "", "seconds": 0.0,
                                          "rss_mib": 0.0}


def main() -> None:
    time_limit = float(sys.argv[1])
    for source in json.load(sys.stdin):
        print(json.dumps(_probe(source, time_limit)), flush=True)


if __name__ == "__main__":
    main()
