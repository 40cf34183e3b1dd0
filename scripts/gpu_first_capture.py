"""Decode after the process's first capture of the decode graph, by how it is made (one variant per process):
``first`` as the product does; ``eager`` after one eager decode step (its buffers allocated on the main stream
before the graph's warm-up); ``dropped`` with both decode captures made once and dropped before the kept ones;
``twice`` with the decode graph dropped after use and captured again. GPU runs 196-201 (run 196 in one process, by
a section since folded into ``twice``): a recapture makes TinyLlama 1.7-2.1% faster and Llama-3.2 1.9-2.4% slower
(cause not found), so the product captures once.
Usage: PYTHONPATH=src python3 scripts/gpu_first_capture.py MODEL VARIANT"""

from __future__ import annotations

import sys

import numpy as np

from quanta.backends.cuda.graphs import DecodeGraph
from quanta.bench.engines import QuantaEngine
from quanta.bench.runner import _prompt

path, variant = sys.argv[1], sys.argv[2]
engine = QuantaEngine(path, device="cuda", threads=1, n_ctx=1024 + 128 + 8)  # the bench's (gpu_common.BENCH_N_CTX)
llm = engine.llm
be, model = llm.backend, llm.model
prompts = {0: _prompt(model.n_vocab, 8), 1024: _prompt(model.n_vocab, 1024, seed=1)}
if variant == "eager":
    be.graphs = False
    be.forward(model, np.asarray([7], np.int32), 0, llm.kv.arena, all_logits=False)
    be.graphs = True
if variant == "dropped":
    shipped = be._decode_graph

    def dropped_first(model, cache, token, start):
        if (id(model), id(cache)) not in be._graphs:
            first = DecodeGraph(model, cache, be.device, token, start)
            for _ in first.greedy(be._argmax_of(model.n_vocab), token, start, 0):
                pass
            del first
        return shipped(model, cache, token, start)
    be._decode_graph = dropped_first
for depth, prompt in prompts.items():
    engine.run(prompt, 4)
    engine.run(prompt, 4)
if variant == "twice":
    for key in [k for k, g in be._graphs.items() if isinstance(g, DecodeGraph)]:
        del be._graphs[key]
    engine.run(prompts[0], 4)
rates = {d: [engine.run(p, 128).decode_tok_s for _ in range(5)] for d, p in prompts.items()}
print(f"{variant:7s} {path.split('/')[-1]:28s} " + ", ".join(
    f"@{d} {np.median(v):.0f} {[round(x) for x in v]}" for d, v in rates.items()), flush=True)
