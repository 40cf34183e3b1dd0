"""Error types a user can act on, and the test the CLI uses to tell them from bugs."""

from __future__ import annotations


class QuantaError(Exception):
    """Base for errors caused by input (files, names, arguments, prompts), not by a bug."""


class UnsupportedModelError(QuantaError):
    """The GGUF's architecture is not one quanta implements."""


class ContextOverflowError(QuantaError):
    """The prompt (plus the tokens asked for) does not fit in the context."""


class NoCUDAError(QuantaError):
    """``--device cuda`` where torch sees no NVIDIA GPU."""

    def __init__(self) -> None:
        super().__init__("--device cuda needs an NVIDIA GPU with a CUDA build of torch; none was found")


def is_user_error(e: BaseException) -> bool:
    """True for errors caused by the user's input (bad file, unknown model, bad argument), not by a bug."""
    from quanta.gguf import GGUFError
    from quanta.hub import ModelNotFoundError, PullError
    from quanta.quant.formats import UnsupportedTypeError

    return isinstance(e, (QuantaError, GGUFError, ModelNotFoundError, PullError, UnsupportedTypeError,
                          FileNotFoundError, IsADirectoryError, PermissionError, ValueError))
