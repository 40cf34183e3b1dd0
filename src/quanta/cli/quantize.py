"""`quanta quantize IN OUT --type T`: re-quantize a GGUF file with llama.cpp's mixture rules.

OUT is replaced only when the new file is complete; an interrupted or failed run leaves no ``OUT.part`` behind,
and an OUT that is not a regular file (a FIFO, a device, a directory) is refused.
"""

from __future__ import annotations

import argparse

QUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "F16", "BF16")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="a GGUF file or a known model name")
    p.add_argument("output", metavar="OUT", help="the GGUF file to write")
    p.add_argument("--type", required=True, choices=QUANTIZE_TYPES, metavar="T", dest="file_type",
                   help=f"target file type: {', '.join(QUANTIZE_TYPES)}")


def run(args: argparse.Namespace) -> int:
    from collections import Counter

    from quanta.gguf import check_destination
    from quanta.hub import resolve_model
    from quanta.quant.convert import convert_file

    out = check_destination(args.output)  # before the long work; the writer removes OUT.part on any failure
    src = resolve_model(args.input, home=args.home)
    written = convert_file(src, out, args.file_type)
    counts = ", ".join(f"{n} {t}" for t, n in Counter(written.values()).most_common())
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.file_type}): {counts}")
    return 0
