"""Error types a user can act on, and the test the CLI uses to tell them from bugs."""

from __future__ import annotations

import os


class QuantaError(Exception):
    """Base for errors caused by input (files, names, arguments, prompts), not by a bug."""


class GGUFError(QuantaError, ValueError):
    """A malformed GGUF file, or one whose model contradicts itself; the message names the reason (the key or
    tensor and what was expected) and, for the container, the byte offset."""

    def __init__(self, reason: str, offset: int | None = None, path: str | os.PathLike | None = None):
        where = f" at byte {offset}" if offset is not None else ""
        name = f"{path}: " if path is not None else ""
        super().__init__(f"{name}{reason}{where}")
        self.reason = reason
        self.offset = offset


class UnsupportedModelError(QuantaError):
    """The GGUF's architecture, or a feature or tensor type its model uses, is not one quanta implements."""


class ContextOverflowError(QuantaError):
    """The prompt (plus the tokens asked for) does not fit in the context."""


class NoCUDAError(QuantaError):
    """``--device cuda`` where torch sees no NVIDIA GPU."""

    def __init__(self) -> None:
        super().__init__("--device cuda needs an NVIDIA GPU with a CUDA build of torch; none was found")


def is_user_error(e: BaseException) -> bool:
    """True for errors caused by the user's input (bad file, unknown model, bad argument), not by a bug."""
    from quanta.hub import ModelNotFoundError, PullError
    from quanta.quant.formats import UnsupportedTypeError

    return isinstance(e, (QuantaError, ModelNotFoundError, PullError, UnsupportedTypeError,
                          FileNotFoundError, IsADirectoryError, PermissionError, ValueError))
