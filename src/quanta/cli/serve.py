"""`quanta serve [-m MODEL] [--host H] [--port P] ...`: an OpenAI-compatible HTTP server with a web chat page.

Binds 127.0.0.1 unless ``--host`` says otherwise; prints the URL once the model is loaded. The API key comes
from ``--api-key`` or the QUANTA_API_KEY environment variable (which keeps it out of the process list).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from quanta.cli.run import add_model_options

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $QUANTA_API_KEY, else no key)")
    p.add_argument("--max-queue", type=int, default=512,
                   help="requests that may wait for a batch slot; more get 429 with Retry-After (default 512)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browsers on this origin call the API ('*' for any; repeatable)")
    p.add_argument("--max-seqs", type=int, default=None, help="sequences decoded together (default: CPU 8, CUDA 256)")
    p.add_argument("--kv-blocks", type=int, default=None, help="blocks in the KV cache (16 tokens each)")
    p.add_argument("--kv-memory", default=None, metavar="SIZE",
                   help="KV-cache size in bytes, or with a unit: 512M, 2G (default: max-seqs full contexts)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish (default 30)")


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"512M"``, ``"2G"``, ``"1.5GiB"``."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ValueError(f"--kv-memory must be a size such as 512M or 2G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def model_name(model: str | None, path: Path) -> str:
    """The name /v1/models lists: the known model's name, else the file's stem."""
    from quanta.hub import DEFAULT_MODEL, KNOWN_MODELS

    name = model or DEFAULT_MODEL
    return name if name in KNOWN_MODELS else path.stem


def run(args: argparse.Namespace) -> int:
    from quanta import prepare_cpu_runtime
    from quanta.hub import resolve_model
    from quanta.server.config import ServerConfig
    from quanta.server.http import serve

    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("QUANTA_API_KEY"),
                          max_queue=args.max_queue, cors_origins=tuple(args.cors_origin or ()),
                          shutdown_grace_s=args.shutdown_grace)
    engine = {"max_seqs": args.max_seqs, "kv_blocks": args.kv_blocks,
              "kv_memory": parse_size(args.kv_memory) if args.kv_memory else None}
    path = resolve_model(args.model, home=getattr(args, "home", None), progress=True)
    prepare_cpu_runtime()

    def load():  # noqa: ANN202 - runs in the server's loader thread
        from quanta.api import LLM

        return LLM(path, device=args.device, n_ctx=args.n_ctx, threads=args.threads, exact=args.exact,
                   **{k: v for k, v in engine.items() if v is not None})

    return serve(config, load, model_name(args.model, path))
