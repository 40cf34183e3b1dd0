"""`quanta serve [-m MODEL] [--host H] [--port P] ...`: an OpenAI-compatible HTTP server with a web chat page.

Binds 127.0.0.1 unless ``--host`` says otherwise; prints the URL once the model is loaded. The API key comes
from ``--api-key`` or the QUANTA_API_KEY environment variable (which keeps it out of the process list).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from quanta.cli.run import add_engine_options, add_model_options, engine_kwargs


def add_parser(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $QUANTA_API_KEY, else no key)")
    p.add_argument("--max-queue", type=int, default=512,
                   help="requests that may wait for a batch slot; more get 429 with Retry-After (default 512)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browsers on this origin call the API ('*' for any; repeatable)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish (default 30)")


def model_name(model: str | None, path: Path) -> str:
    """The name /v1/models lists: the known model's name, else the file's stem."""
    from quanta.hub import DEFAULT_MODEL, KNOWN_MODELS

    name = model or DEFAULT_MODEL
    return name if name in KNOWN_MODELS else path.stem


def run(args: argparse.Namespace) -> int:
    from quanta.hub import resolve_model
    from quanta.server.config import ServerConfig
    from quanta.server.http import serve

    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("QUANTA_API_KEY"),
                          max_queue=args.max_queue, cors_origins=tuple(args.cors_origin or ()),
                          shutdown_grace_s=args.shutdown_grace)
    engine = engine_kwargs(args)
    path = resolve_model(args.model, home=args.home, progress=True)

    load = dict(model=path, device=args.device, n_ctx=args.n_ctx, threads=args.threads, exact=args.exact,
                cpu_isa=args.cpu_isa, cuda=args.cuda, tensor_parallel=args.tensor_parallel, home=args.home,
                **engine)  # LLM's, in the engine process
    return serve(config, load, model_name(args.model, path))
