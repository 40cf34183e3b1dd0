"""Errors of the tokenizer and of chat-template rendering (both are the user's input, not bugs)."""

from __future__ import annotations

from quanta.errors import QuantaError


class TokenizerError(QuantaError):
    """The GGUF's tokenizer is missing, malformed, or of a kind quanta does not implement."""


class ChatTemplateError(QuantaError):
    """A chat template failed to parse or render, or did something a template may not do."""


class RenderTooLongError(ChatTemplateError):
    """A chat template's output ran past the length asked for (or past the render limit)."""
