"""Architectures quanta implements, and ``load_model``: a GGUF file → a Model on a backend."""

from __future__ import annotations

from quanta.backends.base import Backend
from quanta.errors import UnsupportedModelError
from quanta.gguf import GGUFFile
from quanta.models.base import Model
from quanta.models.config import ModelConfig
from quanta.models.gemma3 import Gemma3
from quanta.models.llama import Llama
from quanta.models.qwen2 import Qwen2

ARCHITECTURES: dict[str, type[Model]] = {m.arch: m for m in (Llama, Qwen2, Gemma3)}


def model_class(arch: str) -> type[Model]:
    """The Model class for a GGUF ``general.architecture``; UnsupportedModelError names the supported ones."""
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (supported: {supported})") from None


def load_model(gguf: GGUFFile, backend: Backend, n_ctx: int) -> Model:
    """Read the config from ``gguf``'s metadata and load its tensors onto ``backend`` for ``n_ctx`` positions."""
    arch = str(gguf.metadata.get("general.architecture", "<missing>"))
    cls = model_class(arch)
    embd = gguf.tensors.get("token_embd.weight")
    config = ModelConfig.from_metadata(gguf.metadata, embd.shape[0] if embd is not None else 0)
    return cls(gguf, config, backend, n_ctx)


__all__ = ["ARCHITECTURES", "Model", "ModelConfig", "load_model", "model_class"]
