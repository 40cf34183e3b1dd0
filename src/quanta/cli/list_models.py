"""`quanta list`: the models in the cache (name, size, path)."""

from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the list as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from quanta.hub import KNOWN_MODELS, list_cached, quanta_home

    home = args.home
    models = list_cached(home)
    if args.json:
        print(json.dumps([{"name": n, "bytes": size, "path": str(p)} for n, p, size in models], indent=2))
        return 0
    if not models:
        print(f"no models in {quanta_home(home) / 'models'}; get one with `quanta pull NAME` "
              f"(known: {', '.join(KNOWN_MODELS)})")
        return 0
    width = max(len(n) for n, _, _ in models)
    for name, path, size in models:
        print(f"{name:<{width}}  {size / 2**20:9.1f} MiB  {path}")
    return 0
