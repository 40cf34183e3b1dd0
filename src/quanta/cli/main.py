"""The `quanta` command: one module per verb under quanta.cli, each with ``add_parser`` and ``run``.

Verb modules are imported only when their verb runs, so `quanta --help` and light verbs start fast (numba, torch
and the kernels load only for verbs that compute). User mistakes end with a one-line error, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# verb -> (module under quanta.cli, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "run": ("run", "generate text from a prompt (streams as it goes)"),
    "chat": ("chat", "interactive multi-turn chat"),
    "pull": ("pull", "download a known model into the cache"),
    "list": ("list_models", "list the models in the cache"),
    "inspect": ("inspect", "show a model's architecture, tokenizer and tensor table"),
    "quantize": ("quantize", "convert a GGUF file to another quantization type"),
    "synth": ("synth", "write a random-weight model with the shapes of a real one"),
    "bench": ("bench", "measure prefill/decode speed against the roofline (and llama.cpp)"),
    "serve": ("serve", "serve the model over an OpenAI-compatible HTTP API, with a web chat page"),
}


class UserError(Exception):
    """A mistake the user can fix: printed as `quanta: error: ...` with exit status 2 (1 for runtime failures)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quanta", description="LLM inference for quantized GGUF models (CPU: numba, GPU: Triton).")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        _load(module).add_parser(p)
    return parser


def _version() -> str:
    from quanta import __version__

    return f"quanta {__version__}"


def _load(module: str):
    return importlib.import_module(f"quanta.cli.{module}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.environ.get("QUANTA_HOME"):
        args.home = os.environ["QUANTA_HOME"]
    try:
        return int(_load(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the single place where errors become messages
        if os.environ.get("QUANTA_DEBUG"):
            raise
        from quanta.errors import is_user_error

        print(f"quanta: error: {e}", file=sys.stderr)
        return 2 if is_user_error(e) else 1


if __name__ == "__main__":
    sys.exit(main())
