"""Hunt the graph-against-eager flake of tests/backends/cuda/test_graphs.py in one process (H200).

Runs the test's three cases (llama fast, llama exact, gemma3 fast) in a loop; on any difference it prints which
conversation, prompt and logits differ, by how much, and replays the same conversation again to see whether the
difference repeats.  Usage: PYTHONPATH=src:tests/backends/cuda python3 scripts/gpu_flake.py [repetitions]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from test_graphs import MIXED, _turns
from tiny_models import write_tiny_model

from quanta import gguf
from quanta.backends.cuda.backend import CUDABackend
from quanta.models import load_model

CASES = [("llama", MIXED, False), ("llama", MIXED, True), ("gemma3", {"token_embd": "F16"}, False)]
CONVERSATIONS = [[9, 17, 100], [16, 30, 5], [200, 3, 21], [230, 17]]


def run(g, exact: bool, graphs: bool, prompts: list[list[int]]):
    be = CUDABackend("cuda", exact=exact, graphs=graphs)
    model = load_model(g, be, 256)
    return _turns(be, model, be.kv_cache(model.kv_shape()), prompts)


def compare(tag: str, want, got) -> bool:
    (wl, wt), (gl, gt) = want, got
    same = True
    for i, (a, b) in enumerate(zip(wl, gl)):
        d = np.abs(a - b)
        if not np.all(d <= 1e-5 + 1e-5 * np.abs(a)):
            same = False
            print(f"  {tag} prompt {i}: max |diff| {d.max():.3e} at {np.unravel_index(d.argmax(), d.shape)}, "
                  f"{int((d > 1e-5).sum())} of {d.size} over 1e-5; nan {np.isnan(b).sum()}", flush=True)
    if wt != gt:
        same = False
        print(f"  {tag} tokens differ: {wt} vs {gt}", flush=True)
    return same


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    tmp = Path(tempfile.mkdtemp())
    files = {arch: gguf.open(write_tiny_model(tmp / f"{arch}{i}.gguf", arch, types=types, d_model=256, d_ff=256,
                                              vocab=64)) for i, (arch, types, _) in enumerate(CASES)}
    fails = 0
    t0 = time.time()
    for rep in range(reps):
        for arch, _, exact in CASES:
            g = files[arch]
            rng = np.random.default_rng(1)
            for c, lengths in enumerate(CONVERSATIONS):
                prompts = [rng.integers(1, 64, size=n).tolist() for n in lengths]
                eager = run(g, exact, False, prompts)
                graph = run(g, exact, True, prompts)
                tag = f"rep {rep} {arch} exact={exact} conv {c} {lengths}"
                if not compare(tag + " graph/eager", eager, graph):
                    fails += 1
                    compare(tag + " eager/eager again", eager, run(g, exact, False, prompts))
                    compare(tag + " graph/graph again", graph, run(g, exact, True, prompts))
        torch.cuda.synchronize()
        print(f"rep {rep} done, {fails} failures, {time.time() - t0:.0f} s", flush=True)
    print(f"FLAKE SUMMARY: {fails} failing conversations in {reps} repetitions")


if __name__ == "__main__":
    main()
