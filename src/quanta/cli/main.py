"""The `quanta` command: one module per verb under quanta.cli, each with ``add_parser`` and ``run``.

Verb modules are imported only when their verb runs, so `quanta --help` and light verbs start fast (numba, torch
and the kernels load only for verbs that compute). The environment is read here, once: ``QUANTA_HOME`` (the
model cache; checked, then passed down as ``args.home``), ``QUANTA_DEBUG`` (tracebacks instead of messages), and the
GPU backend's switches ``QUANTA_Q8=0`` (float activations in the decode matmuls) and ``QUANTA_PDL=0`` (no
programmatic dependent launch), passed down as ``args.cuda``.
Every mistake ends in one line on stderr: `quanta VERB: error: ...` with exit status 2 for a bad command line,
`quanta: error: ...` for what went wrong while running (2 when the input or the environment is at fault, 1 for
a bug).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from typing import NoReturn

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

# OSErrors the user can act on (disk full, read-only or missing places): exit status 2, not 1
_ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                                 errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP})


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a mistake on one line (`quanta VERB: error: ...`, exit status 2), not with its
    usage block; the subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="quanta", description="LLM inference for quantized GGUF models (CPU: numba, GPU: Triton).")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        p.set_defaults(_module=module, _parser=p)
        _load(module).add_parser(p)
    return parser


def _version() -> str:
    from quanta import __version__

    return f"quanta {__version__}"


def _load(module: str):
    return importlib.import_module(f"quanta.cli.{module}")


def _exit_status(e: Exception) -> int:
    from quanta.errors import is_user_error

    environment = isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS
    return 2 if is_user_error(e) or environment else 1


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # reported by the verb's parser, which names the verb
            args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help, --version, or a mistake already reported
        return e.code if isinstance(e.code, int) else 0
    args.home = os.environ.get("QUANTA_HOME") or None
    args.cuda = {"q8": os.environ.get("QUANTA_Q8", "1") != "0",
                 "pdl": False if os.environ.get("QUANTA_PDL", "1") == "0" else None}
    try:
        if args.home is not None:
            from quanta.hub import check_home

            check_home(args.home)
        return int(_load(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the single place where errors become messages
        if os.environ.get("QUANTA_DEBUG"):
            raise
        print(f"quanta: error: {_one_line(e)}", file=sys.stderr)
        return _exit_status(e)


if __name__ == "__main__":
    sys.exit(main())
