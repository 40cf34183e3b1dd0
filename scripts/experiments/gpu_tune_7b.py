"""One-off: the int8 GEMV's tiles on Llama-2-7B's decode matmuls (batch 1), each class of weight timed as all its
layers' launches captured in one graph (distinct weights: no L2 reuse). Prints GB/s per config."""
import itertools, json, sys, time
import numpy as np, torch
from quanta import LLM
from quanta.backends.cuda import q8gemv
from quanta.backends.cuda.qmatmul import _Epilogue, tile_key, gemv_class

path, out = sys.argv[1], sys.argv[2]
llm = LLM(path, device="cuda", n_ctx=256, max_seqs=1)
groups = {}
for layer in llm.model.layers:
    projs = list(layer.qkv) + list(layer.gate_up)
    mats = [p.weight.packed if p.fused else p.weight for p in projs]
    mats += [layer.attn_output, layer.ffn_down]
    for w in mats:
        groups.setdefault((w.type, w.n, w.k), []).append(w)
h = llm.model.output
groups[(h.type + " head", h.n, h.k)] = [h]
print({k: len(v) for k, v in groups.items()}, flush=True)

def time_group(ws, reps=15):
    k = ws[0].k
    x = torch.randn(1, k, device="cuda")
    xq = q8gemv.quantize(x)
    eps = [_Epilogue(torch.empty(1, w.n, device="cuda"), None, None, None, w.n) for w in ws]
    for w, ep in zip(ws, eps):
        q8gemv.gemv_q8(xq, w, ep, True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w, ep in zip(ws, eps):
            q8gemv.gemv_q8(xq, w, ep, True)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ms = float(np.median(ts))
    return ms, sum(w.nbytes for w in ws) / ms / 1e6

res = {}
t0 = time.time()
BUDGET = float(sys.argv[3]) if len(sys.argv) > 3 else 300

def tune(key, ws):
    tk = tile_key(ws[0])
    base = dict(q8gemv.Q8_CONFIG[tk])
    ms0, gbs0 = time_group(ws)
    print(f"{key} x{len(ws)} {tk} current {base}: {ms0*1e3/len(ws):.2f} us/launch, {gbs0:.0f} GB/s", flush=True)
    rows = [(dict(base), ms0, gbs0)]
    units = ws[0].k // 32 * (1 if ws[0].kind == "q4" else 2)
    seen = set()
    for bn, bj, nw in itertools.product((1, 2, 4, 8), (64, 128, 256), (1, 2, 4)):
        bj = min(bj, 1 << (units - 1).bit_length())
        per = bn * bj / (32 * nw)
        if per < 1 or per > 4 or (bn, bj, nw) in seen or time.time() - t0 > BUDGET:
            continue
        seen.add((bn, bj, nw))
        cfg = {"BN": bn, "BJ": bj, "num_warps": nw, "PRE": 2}
        q8gemv.Q8_CONFIG[tk] = cfg
        try:
            ms, gbs = time_group(ws)
        except Exception as e:
            print("  fail", cfg, repr(e)[:200], flush=True)
            continue
        finally:
            q8gemv.Q8_CONFIG[tk] = base
        rows.append((cfg, ms, gbs))
    rows.sort(key=lambda r: r[1])
    for cfg, ms, gbs in rows[:6]:
        print(f"   {cfg}: {ms*1e3/len(ws):.2f} us/launch, {gbs:.0f} GB/s", flush=True)
    res[str(key)] = {"count": len(ws), "class": str(tk), "current": [base, ms0, gbs0], "ranked": rows}
    json.dump(res, open(out, "w"), indent=1)

for key, ws in sorted(groups.items(), key=lambda kv: -sum(w.nbytes for w in kv[1])):
    try:
        tune(key, ws)
    except Exception as e:
        print("group failed", key, repr(e)[:300], flush=True)
print(f"tune done in {time.time()-t0:.0f} s")
