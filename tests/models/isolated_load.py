"""Load GGUF files in a separate process with time and memory limits, so a crash fails a test, not pytest.

The worker (this file run as a script) reads one path per stdin line, opens it (``quanta.gguf.open``), builds the
model on the CPU backend (``quanta.models.load_model``) and, when that succeeds, runs a short forward through the
public API (``quanta.LLM(...).logits``); it answers one JSON line per path. ``IsolatedLoader`` drives it: a worker
that dies or stops answering is recorded against the file it was on ("crash" / "hang") and replaced.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

FORWARD_IDS = (1, 2, 3)  # plus the last token id: its embedding row is the one past-the-end reads hit first
MEMORY_LIMIT = 4 << 30  # the worker's address space (it maps ~0.3 GiB at start, a tiny model loaded)


def _outcome(path: str, backend: Any) -> dict[str, Any]:
    """``ok`` (finite logits), ``refused`` (a QuantaError, at ``stage``), ``nonfinite`` or ``bug``."""
    import numpy as np

    import quanta
    from quanta.errors import QuantaError
    from quanta.models import load_model

    stage = "load"
    try:
        with quanta.gguf.open(path) as f:
            model = load_model(f, backend)  # the context the file asks for (context_length, at most 4,096)
            n_vocab = model.n_vocab
            del model
        stage = "forward"
        with quanta.LLM(path, device="cpu", threads=1) as llm:
            logits = llm.logits([*FORWARD_IDS, n_vocab - 1])
        return {"outcome": "ok" if np.isfinite(logits).all() else "nonfinite"}
    except QuantaError as e:
        return {"outcome": "refused", "stage": stage, "error": type(e).__name__, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - what the test is looking for
        return {"outcome": "bug", "stage": stage, "error": type(e).__name__, "message": str(e)[:500],
                "traceback": traceback.format_exc()[-3000:]}


def _worker() -> None:
    import quanta.gguf  # noqa: F401 (quanta.gguf.open)
    from quanta.backends import get_backend

    backend = get_backend("cpu", threads=1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_outcome(line.strip(), backend)), flush=True)


def _limit_resources() -> None:
    """In the worker, before it starts: its address space capped, no core files from its crashes."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT if hard == resource.RLIM_INFINITY else
                                            min(MEMORY_LIMIT, hard), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


class IsolatedLoader:
    """``loader.load(path)`` → the worker's outcome dict, or ``{"outcome": "crash" | "hang", ...}``."""

    def __init__(self, timeout_s: float = 60.0, start_timeout_s: float = 300.0):
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: warnings can never fill it and block
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env, preexec_fn=_limit_resources)
        ready = self._answer(self.start_timeout_s)
        assert ready == {"ready": True}, f"the worker did not start: {ready}"

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            return {"outcome": "hang", "seconds": timeout_s}
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            return {"outcome": "crash", "returncode": self.proc.returncode, "stderr": self.stderr.read()[-3000:]}
        return json.loads(line)

    def load(self, path: Path) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{path}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died after its last answer
            pass
        answer = self._answer(self.timeout_s)
        if answer["outcome"] in ("hang", "crash"):
            self.close()
        return answer

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.stderr.close()

    def __enter__(self) -> IsolatedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _worker()
