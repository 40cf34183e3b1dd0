"""`quanta inspect MODEL [--json] [--check]`: architecture, hyper-parameters, tokenizer, tensor table, sizes;
``--check`` also scans every weight for NaN/inf (exit status 1 when a tensor holds any)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from quanta.gguf import TensorInfo

CHECK_CHUNK_ELEMENTS = 1 << 20  # weights dequantized per step of --check: a few MB of fp32 at a time


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a GGUF file or a known model name")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.add_argument("--tensors", type=int, default=None, metavar="N",
                   help="show only the first N rows of the tensor table (default: all)")
    p.add_argument("--check", action="store_true",
                   help="scan every weight for NaN/inf (dequantized block by block); exit status 1 if any holds one")


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def describe(path: str | Path) -> dict[str, Any]:
    """Everything `inspect` shows, as plain JSON-able values."""
    from quanta.gguf import open_gguf

    with open_gguf(path) as f:
        md = f.metadata
        arch = f.architecture or "?"
        hyper = {k[len(arch) + 1:]: _plain(v) for k, v in md.items()
                 if k.startswith(arch + ".") and not (isinstance(v, (list, np.ndarray)) and len(v) > 64)}
        tokens = md.get("tokenizer.ggml.tokens")
        tokenizer = {
            "model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens) if tokens is not None else None,
            "merges": len(md["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in md else None,
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
            "chat_template": "tokenizer.chat_template" in md,
        }
        tensors = [{"name": t.name, "type": t.type, "shape": list(t.shape), "bytes": t.nbytes}
                   for t in f.tensors.values()]
        by_type: dict[str, dict[str, int]] = {}
        for t in f.tensors.values():
            row = by_type.setdefault(t.type, {"tensors": 0, "parameters": 0, "bytes": 0})
            row["tensors"] += 1
            row["parameters"] += t.n_elements
            row["bytes"] += t.nbytes
        n_params = sum(r["parameters"] for r in by_type.values())
        n_bytes = sum(r["bytes"] for r in by_type.values())
        return {
            "path": str(path), "file_bytes": f.file_size, "gguf_version": f.version, "architecture": arch,
            "name": md.get("general.name"), "file_type": md.get("general.file_type"), "hyperparameters": hyper,
            "tokenizer": tokenizer, "tensors": tensors,
            "totals": {"tensors": len(tensors), "parameters": n_params, "bytes": n_bytes,
                       "bits_per_weight": 8 * n_bytes / n_params if n_params else 0.0},
            "by_type": {k: {**v, "bits_per_weight": 8 * v["bytes"] / v["parameters"]} for k, v in
                        sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])},
        }


def nonfinite_counts(tensor: TensorInfo) -> tuple[int, int] | None:
    """(NaN count, ±inf count) of the tensor's weights, dequantized a chunk of blocks at a time through the
    reference dequantizer (never a whole fp32 copy); None for a ggml type quanta cannot decode."""
    from quanta.quant import FORMATS, dequantize_raw

    fmt = FORMATS.get(tensor.type)
    if fmt is None:
        return None
    blocks_per_chunk = max(1, CHECK_CHUNK_ELEMENTS // fmt.block_size)
    step = blocks_per_chunk * fmt.type_size
    nan = inf = 0
    for start in range(0, tensor.nbytes, step):
        raw = tensor.raw[start : start + step]
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales are what the scan looks for
            w = dequantize_raw(raw, tensor.type, (raw.size // fmt.type_size * fmt.block_size,), tensor.name)
        nan += int(np.isnan(w).sum())
        inf += int(np.isinf(w).sum())
    return nan, inf


def check_weights(path: str | Path) -> list[dict[str, Any]]:
    """Every tensor holding NaN/inf (name, type, counts) and every one whose type cannot be decoded (counts None)."""
    from quanta.gguf import open_gguf

    found = []
    with open_gguf(path) as f:
        for t in f.tensors.values():
            counts = nonfinite_counts(t)
            if counts is None or any(counts):
                found.append({"name": t.name, "type": t.type, "nan": counts and counts[0], "inf": counts and counts[1]})
    return found


def _print_check(found: list[dict[str, Any]]) -> None:
    bad = [r for r in found if r["nan"] is not None]
    for r in found:
        if r["nan"] is None:
            print(f"check: {r['name']} ({r['type']}) not scanned: quanta cannot decode {r['type']}")
    for r in bad:
        print(f"check: {r['name']} ({r['type']}) holds {r['nan']:,} NaN and {r['inf']:,} inf weights")
    print(f"check: {len(bad)} tensor(s) with non-finite weights" if bad else "check: every weight is finite")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _print(d: dict[str, Any], max_tensors: int | None) -> None:
    print(f"{d['path']}  ({_mib(d['file_bytes'])}, GGUF v{d['gguf_version']})")
    print(f"architecture: {d['architecture']}   name: {d['name']}   file_type: {d['file_type']}")
    print("hyper-parameters:")
    for k, v in d["hyperparameters"].items():
        print(f"  {k:<40} {v:.7g}" if isinstance(v, float) else f"  {k:<40} {v}")
    tok = d["tokenizer"]
    print(f"tokenizer: {tok['model']} (pre: {tok['pre']})  vocab {tok['vocab_size']}"
          + (f"  merges {tok['merges']}" if tok["merges"] is not None else "")
          + f"  bos {tok['bos_token_id']}  eos {tok['eos_token_id']}"
          + f"  chat template: {'yes' if tok['chat_template'] else 'no'}")
    rows = d["tensors"] if max_tensors is None else d["tensors"][:max_tensors]
    width = max((len(t["name"]) for t in rows), default=4)
    print(f"tensors ({d['totals']['tensors']}):")
    for t in rows:
        shape = "x".join(map(str, t["shape"]))
        print(f"  {t['name']:<{width}}  {t['type']:<5} {shape:>14}  {t['bytes']:>12,} B")
    if len(rows) < len(d["tensors"]):
        print(f"  ... {len(d['tensors']) - len(rows)} more")
    print("by type:")
    for name, r in d["by_type"].items():
        print(f"  {name:<5} {r['tensors']:5d} tensors {r['parameters']:>14,} weights {_mib(r['bytes']):>14}"
              f"  {r['bits_per_weight']:.2f} bits/weight")
    tot = d["totals"]
    print(f"total: {tot['parameters']:,} weights, {_mib(tot['bytes'])}, {tot['bits_per_weight']:.3f} bits/weight")


def run(args: argparse.Namespace) -> int:
    import json

    from quanta.hub import resolve_model

    path = resolve_model(args.model, home=getattr(args, "home", None))
    d = describe(path)
    found = check_weights(path) if args.check else []
    if args.json:
        print(json.dumps({**d, "nonfinite": found} if args.check else d, indent=1))
    else:
        _print(d, args.tensors)
        if args.check:
            _print_check(found)
    return 1 if any(r["nan"] for r in found) or any(r["inf"] for r in found) else 0
