"""Compile the decode GEMV for sm_90 on a machine without a GPU and count what matters per weight: vector
loads, barriers, and SASS instructions of the main loop (Triton's own ptxas/cuobjdump; no device time).

Usage: PYTHONPATH=src python3 scripts/gpu_ptx.py [--q8] [FORMAT BN BJ WARPS [masked]]   (FORMAT: Q4_K, Q6_K, Q4_0, Q8_0)
Compile with the Triton the GPU runs (3.6; PyPI's newer versions lay the same kernels out differently, GPU journal
run 37): ``pip install --no-deps --target /tmp/tr36 triton==3.6.0`` and put /tmp/tr36 first on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quanta.backends.cuda import q8gemv as q8m
from quanta.backends.cuda import qmatmul as qm

FORMATS = {  # name: (BITS, HB, G, SB, QOFF, HAS_SC, HAS_MIN, HAS_MN)
    "Q4_K": (4, 0, 32, 256, 0, True, True, True), "Q6_K": (4, 2, 16, 256, 32, True, False, False),
    "Q5_K": (4, 1, 32, 256, 0, True, True, True), "Q4_0": (4, 0, 32, 32, 8, False, False, False),
    "Q8_0": (8, 0, 32, 32, 128, False, False, False),
}


def compile_gemv(fmt: str, bn: int, bj: int, warps: int, masked: bool = False, pdl: bool = True, q8: bool = False,
                 rope: str = "", pre2: bool = False):
    """The float GEMV, or (q8) the int8-activation GEMV of q8gemv.py, compiled for sm_90 (rope: "", "llama" or
    "neox": with the rope epilogue; pre2: the int8 GEMV's first two K steps before the wait)."""
    bits, hb, g, sb, qoff, has_sc, has_min, has_mn = FORMATS[fmt]
    fn = q8m._gemv_q8_kernel if q8 else qm._gemv_kernel
    x_args = {"xq_ptr": "*i32", "xd_ptr": "*fp32"} if q8 else {"x_ptr": "*fp32"}
    sig = {**x_args, "q_ptr": "*i32", "qh_ptr": "*i32", "d_ptr": "*fp16", "sc_ptr": "*i8", "dmin_ptr": "*fp16",
           "mn_ptr": "*u8", "res_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp32", "y1_ptr": "*fp32",
           "y2_ptr": "*fp32", "N": "i32", "N1": "i32", "N2": "i32", "K": "i32", "QW": "i32", "QHW": "i32",
           **({} if q8 else {"stride_x": "i32"}), "stride_y": "i32", "pos_ptr": "*i32", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "ROW0": "i32", "HD": "i32", "HALF": "i32", "NCTX": "i32"}
    consts = dict(BITS=bits, HB=hb, G=g, SB=sb, QOFF=qoff, HAS_SC=has_sc, HAS_MIN=has_min, HAS_MN=has_mn, HAS_RES=False,
                  HAS_BIAS=False, SPLIT=False, ROPE=bool(rope), NEOX=rope == "neox", BN=bn, BJ=bj, MASKED=masked,
                  **({"EMULATE": False, "PRE2": pre2} if q8 else {}), PDL=pdl)
    for k in consts:
        sig[k] = "constexpr"
    div = [["tt.divisibility", 16]]
    attrs = {(fn.arg_names.index(a),): div for a in sig if a in fn.arg_names and sig[a] != "constexpr"
             and a not in ("N1", "N2", "b_ptr", "y1_ptr", "y2_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "ROW0",
                           "HALF", "NCTX")}
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def loop_body(code: str) -> list[str]:
    """The SASS lines of the innermost backward branch's body (the K loop)."""
    lines = [ln for ln in code.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(ln.split("/*")[1][:4], 16) for ln in lines]
    best: list[str] = []
    for i, ln in enumerate(lines):
        t = re.search(r"BRA\s.*?0x([0-9a-f]+)", ln)
        if t and int(t.group(1), 16) < addr[i] and int(t.group(1), 16) in addr:
            body = lines[addr.index(int(t.group(1), 16)):i + 1]
            best = body if not best or len(body) < len(best) else best
    return best


def report(fmt: str, bn: int, bj: int, warps: int, masked: bool = False, pdl: bool = True, q8: bool = False) -> None:
    k = compile_gemv(fmt, bn, bj, warps, masked, pdl, q8)
    ptx, code = k.asm["ptx"], cuobjdump(k.asm["cubin"], "--dump-sass")
    res = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(k.asm["cubin"], "--dump-resource-usage"))
    body = loop_body(code)
    ops: dict[str, int] = {}
    for ln in body:
        words = ln.split("*/")[1].strip().split()
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    # weights per thread and loop iteration: the [BN, BJ, 4] word tile over 32*warps threads
    weights = bn * bj * 4 * (32 // FORMATS[fmt][0]) / (32 * warps)
    top = ", ".join(f"{o}:{n}" for o, n in sorted(ops.items(), key=lambda kv: -kv[1])[:10])
    print(f"{'q8 ' if q8 else ''}{fmt} BN={bn} BJ={bj} W={warps} masked={masked} pdl={pdl}: "
          f"regs {res.group(1)} stack {res.group(2)}, "
          f"ld.v4 {ptx.count('ld.global.v4')}, bar {ptx.count('bar.sync')}, loop {len(body)} SASS = "
          f"{len(body) / weights:.2f} per weight | {top}", flush=True)


if __name__ == "__main__":
    a = [v for v in sys.argv[1:] if v != "--q8"]
    q8 = "--q8" in sys.argv
    if a:
        report(a[0], int(a[1]), int(a[2]), int(a[3]), len(a) > 4, q8=q8)
    else:
        for fmt in FORMATS:
            report(fmt, 2, 64, 2, q8=q8)
