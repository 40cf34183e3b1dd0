"""One-off: the first request's divergence (speculative vs plain greedy, GPU fast mode) under variants."""
import sys
from quanta import LLM
from quanta.bench.speculative import PROMPT_SETS, _decode

path = sys.argv[1]
p0, p1 = PROMPT_SETS["repetitive"][0], PROMPT_SETS["prose"][0]
base = LLM(path, device="cuda", n_ctx=1024, max_seqs=1)
ids0 = base.chat_prompt([{"role": "user", "content": p0}])
ids1 = base.chat_prompt([{"role": "user", "content": p1}])
want, _ = _decode(base, ids0, 64, [])
print("plain", want[:12], flush=True)
for name, kw, warm in (("graphs", {}, False), ("graphs, warmed", {}, True), ("no graphs", {"cuda": {"graphs": False}}, False),
                       ("prefix cache off", {"prefix_caching": False}, False), ("graphs again", {}, False)):
    try:
        spec = LLM(path, device="cuda", n_ctx=1024, max_seqs=1, speculative="ngram", **kw)
    except Exception as e:
        print(name, "failed:", repr(e)[:200], flush=True)
        continue
    if warm:
        _decode(spec, ids1, 64, [])
    st = []
    got, _ = _decode(spec, ids0, 64, st)
    i = next((j for j, (x, y) in enumerate(zip(want, got)) if x != y), None)
    print(f"{name}: first difference at {i}; spec {got[:12]}; verifies {st[0].verify_steps} "
          f"accepted {st[0].accepted_tokens}/{st[0].draft_tokens}", flush=True)
    spec.close()
