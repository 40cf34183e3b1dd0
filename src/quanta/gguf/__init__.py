"""The GGUF container: an mmap reader with full validation, and a streaming writer."""

from quanta.gguf.constants import GGML_TYPES, GGML_TYPES_BY_NAME, GGMLType, ValueType, ggml_type, tensor_nbytes
from quanta.gguf.reader import GGUFError, GGUFFile, TensorInfo, architecture_of, open_gguf
from quanta.gguf.writer import TensorToWrite, Typed, check_destination, encode_metadata, typed, write_gguf

open = open_gguf  # noqa: A001  - `quanta.gguf.open(path)` is the public entry point

__all__ = [
    "GGML_TYPES", "GGML_TYPES_BY_NAME", "GGMLType", "GGUFError", "GGUFFile", "TensorInfo", "TensorToWrite",
    "Typed", "ValueType", "architecture_of", "check_destination", "encode_metadata", "ggml_type", "open",
    "open_gguf", "tensor_nbytes", "typed", "write_gguf",
]
