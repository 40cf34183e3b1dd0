"""One-off: where greedy speculation's tokens part from plain greedy on the GPU (fast mode), and the margin there."""
import sys
import numpy as np
from quanta import LLM
from quanta.bench.speculative import PROMPT_SETS, _decode

path = sys.argv[1]
kw = dict(device="cuda", n_ctx=1024, max_seqs=1)
plain = LLM(path, **kw)
spec = LLM(path, speculative="ngram", **kw)
for name in ("repetitive", "code"):
    for p in PROMPT_SETS[name]:
        ids = plain.chat_prompt([{"role": "user", "content": p}])
        for rep in range(2):
            a, _ = _decode(plain, ids, 128, [])
            st = []
            b, _ = _decode(spec, ids, 128, st)
            if a != b:
                i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                lg = plain.engine.score(ids + a[:i])[-1]
                top = np.sort(lg)[-2:]
                print(f"{name} rep{rep} prompt {p[:30]!r}: at {i} plain {a[i]} spec {b[i]}; teacher-forced logits "
                      f"{lg[a[i]]:.4f} / {lg[b[i]]:.4f}, top-2 gap {top[1]-top[0]:.4f}; verifies {st[0].verify_steps}",
                      flush=True)
            else:
                print(f"{name} rep{rep} prompt {p[:30]!r}: identical; verifies {st[0].verify_steps}", flush=True)
