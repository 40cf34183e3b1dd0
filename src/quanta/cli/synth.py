"""`quanta synth PRESET OUT --type T`: a random-weight model with the shapes and metadata of a real one."""

from __future__ import annotations

import argparse

SYNTH_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "Q4_K_S", "Q4_K_M", "Q5_K_M")


def add_parser(p: argparse.ArgumentParser) -> None:
    from quanta.synth.presets import PRESETS

    p.add_argument("preset", choices=list(PRESETS), metavar="PRESET", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("output", metavar="OUT", help="the GGUF file to write")
    p.add_argument("--type", required=True, choices=SYNTH_TYPES, metavar="T", dest="file_type",
                   help=f"weight type or llama.cpp mix: {', '.join(SYNTH_TYPES)}")
    p.add_argument("--seed", type=int, default=0, help="random seed (weights and tokenizer)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="fewer layers than the preset's (small tests)")
    p.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="a smaller vocabulary than the preset's (its special tokens are kept)")


def run(args: argparse.Namespace) -> int:
    from quanta.gguf import check_destination
    from quanta.synth import get_preset, synthesize

    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    out = check_destination(args.output)
    preset = get_preset(args.preset).with_overrides(layers=args.layers, vocab=args.vocab)
    result = synthesize(preset, out, args.file_type, seed=args.seed)
    print(f"wrote {result.path}: {preset.name} {args.file_type}, {result.bytes / 2**20:.1f} MiB "
          f"in {result.seconds:.1f} s ({result.gb_per_s:.2f} GB/s)")
    return 0
