"""Architectures quanta implements, and ``load_model``: a GGUF file → a Model on a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quanta.backends.base import Backend
from quanta.errors import UnsupportedModelError
from quanta.gguf import GGUFFile
from quanta.models.base import Model
from quanta.models.config import ModelConfig
from quanta.models.gemma3 import Gemma3
from quanta.models.llama import Llama
from quanta.models.qwen2 import Qwen2
from quanta.models.validate import validate

if TYPE_CHECKING:
    from quanta.parallel.group import TensorParallel

ARCHITECTURES: dict[str, type[Model]] = {m.arch: m for m in (Llama, Qwen2, Gemma3)}


def model_class(arch: str) -> type[Model]:
    """The Model class for a GGUF ``general.architecture``; UnsupportedModelError names the supported ones."""
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (supported: {supported})") from None


DEFAULT_N_CTX = 4096  # the context when none is asked for: the model's trained one, at most this


def model_config(gguf: GGUFFile) -> ModelConfig:
    """The config in ``gguf``'s metadata, checked with every tensor against the architecture (``validate``)."""
    model_class(str(gguf.architecture or "<missing>"))
    embd = gguf.tensors.get("token_embd.weight")
    config = ModelConfig.from_metadata(gguf.metadata, embd.shape[0] if embd is not None else 0)
    validate(gguf, config)
    return config


def load_model(gguf: GGUFFile, backend: Backend, n_ctx: int | None = None,
               parallel: TensorParallel | None = None) -> Model:
    """Read and check the config (``model_config``), then load the tensors onto ``backend`` for ``n_ctx``
    positions (None: the trained context, at most ``DEFAULT_N_CTX``); ``parallel``: only this rank's part of them
    (quanta.parallel)."""
    config = model_config(gguf)
    cls = model_class(config.arch)
    return cls(gguf, config, backend, n_ctx or min(config.n_ctx_train, DEFAULT_N_CTX), parallel)


__all__ = ["ARCHITECTURES", "Model", "ModelConfig", "load_model", "model_class", "model_config"]
