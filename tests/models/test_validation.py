"""Model-level validation (issue 32 §4): each class of contradicting or mistyped file is refused with a
GGUFError / UnsupportedModelError naming the key or tensor, before any kernel runs.

Files are tiny synth models and the real SmolLM2's header and first layers, edited by ``model_edits``. The cases
that crashed before validation existed (rope wider than the head: heap corruption; a short norm weight as the
last tensor: a read past the mmap) load in a separate process (``isolated_load``), so a regression fails the
test instead of killing pytest.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from isolated_load import IsolatedLoader
from model_edits import Model, Tensor, read, tiny_model

import quanta
from quanta.backends import get_backend
from quanta.errors import GGUFError, UnsupportedModelError
from quanta.gguf import ValueType
from quanta.models import ModelConfig, load_model

U32, U64, I32, F32, F64, STR = (ValueType.UINT32, ValueType.UINT64, ValueType.INT32, ValueType.FLOAT32,
                                ValueType.FLOAT64, ValueType.STRING)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path) -> dict[str, Model]:
    d = tmp_path_factory.mktemp("valid")
    return {"llama": tiny_model("llama", d / "llama.gguf", "Q4_K_M"), "qwen2": tiny_model("qwen2", d / "q.gguf"),
            "gemma3": tiny_model("gemma3", d / "g.gguf", "Q4_0"), "smollm2": read(smollm2_path, layers=2)}


@pytest.fixture(scope="module")
def loader():
    with IsolatedLoader() as loader:
        yield loader


@pytest.fixture
def edit(models):
    """``edit(source)`` → a copy of that model to change."""
    return lambda source: models[source].copy()


def load(model: Model, path, offsets=None):
    """Build the model on the CPU backend (the errors come from validation, before any kernel)."""
    model.write(path, offsets)
    with quanta.gguf.open(path) as f:
        return load_model(f, get_backend("cpu", threads=1), 32)


def refused(model: Model, path, match: str | None, error: type = GGUFError, offsets=None) -> str:
    with pytest.raises(error, match=match) as e:
        load(model, path, offsets)
    assert type(e.value) is error
    return str(e.value)


@pytest.mark.parametrize("source", ["llama", "qwen2", "gemma3", "smollm2"])
def test_the_unedited_models_load_and_give_finite_logits(models, loader, tmp_path, source):
    assert loader.load(models[source].write(tmp_path / "m.gguf")) == {"outcome": "ok"}


@pytest.mark.parametrize("source, rope_dims", [("smollm2", 128), ("smollm2", 66), ("llama", 65 * 2)])
def test_rope_wider_than_the_head(edit, loader, tmp_path, source, rope_dims):
    m = edit(source)
    path = m.set(f"{m.arch}.rope.dimension_count", rope_dims).write(tmp_path / "m.gguf")
    out = loader.load(path)  # was SIGABRT (heap corruption by the rope kernel)
    assert out["outcome"] == "refused" and out["error"] == "GGUFError", out
    assert f"{m.arch}.rope.dimension_count = {rope_dims} is larger than the head size 64" in out["message"]


def test_odd_rope_dims(edit, tmp_path):
    m = edit("llama")
    refused(m.set("llama.rope.dimension_count", 63), tmp_path / "m.gguf", "rope.dimension_count = 63; expected an even")


@pytest.mark.parametrize("name", ["output_norm.weight", "blk.1.ffn_norm.weight", "blk.0.attn_norm.weight"])
def test_norm_weight_shorter_than_the_width(edit, loader, tmp_path, name):
    m = edit("smollm2")
    m.tensors.append(m.tensors.pop(m.index(name)))  # the file's last tensor: a short read runs past the mmap
    out = loader.load(m.retensor(name, shape=(64,)).write(tmp_path / "m.gguf"))  # was SIGSEGV
    assert out["outcome"] == "refused", out
    assert f"tensor '{name}' has shape (64,); expected (576,) (embedding_length)" in out["message"]


def test_overlapping_data_in_a_real_model(edit, tmp_path):
    m = edit("smollm2")
    offsets = [0]
    for t in m.tensors[:-1]:
        offsets.append(offsets[-1] + -(-t.data.size // m.alignment) * m.alignment)
    offsets[3] = offsets[2]
    refused(m, tmp_path / "m.gguf", f"tensor {m.tensors[3].name}'s data .* overlaps", offsets=offsets)


COUNTS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
          "attention.head_count_kv", "vocab_size"]


@pytest.mark.parametrize("key", COUNTS)
@pytest.mark.parametrize("value, vtype", [(0, U32), (-1, I32), (2**31, U32), (2**32 - 1, U32), (2**63, U64),
                                          (2**64 - 1, U64)])
def test_zero_or_huge_counts(edit, tmp_path, key, value, vtype):
    m = edit("llama")
    refused(m.set(f"llama.{key}", value, vtype), tmp_path / "m.gguf", f"llama.{key} is {value}; expected an integer")


@pytest.mark.parametrize("source, key, value, match", [
    ("llama", "block_count", 3, "block_count = 3, but the file has no tensors of layer 2"),
    ("llama", "block_count", 1, "block_count = 1, but the file has tensors of layer 1"),
    ("llama", "attention.head_count", 3, "head_count = 3 does not divide .*embedding_length = 256"),
    ("llama", "attention.head_count_kv", 3, "head_count = 4 is not a multiple of .*head_count_kv = 3"),
    ("llama", "attention.head_count_kv", 4, r"'blk.0.attn_k.weight' has shape \(128, 256\); expected \(256, 256\)"),
    ("llama", "feed_forward_length", 256, r"'blk.0.ffn_gate.weight' has shape \(512, 256\); expected \(256, 256\)"),
    ("gemma3", "attention.head_count", 2, r"'blk.0.attn_q.weight' has shape \(512, 256\); expected \(256, 256\)"),
    ("smollm2", "embedding_length", 1152, r"'token_embd.weight' has shape \(49152, 576\); expected \(49152, 1152\)"),
    ("smollm2", "vocab_size", 49153, "vocab_size = 49153, but token_embd.weight has 49152 rows"),
])
def test_hyperparameters_that_contradict_each_other_or_the_tensors(edit, tmp_path, source, key, value, match):
    m = edit(source)
    refused(m.set(f"{m.arch}.{key}", value, U32), tmp_path / "m.gguf", match)


@pytest.mark.parametrize("key, value, vtype, match", [
    ("context_length", "8192", STR, "the string '8192'; expected an integer"),
    ("block_count", 2.0, F32, "2.0; expected an integer"),
    ("attention.head_count", True, ValueType.BOOL, r"True \(bool\); expected an integer"),
    ("attention.layer_norm_rms_epsilon", "1e-5", STR, "the string '1e-5'; expected a finite number"),
    ("attention.layer_norm_rms_epsilon", float("nan"), F32, "nan; expected a finite number > 0"),
    ("attention.layer_norm_rms_epsilon", 0.0, F32, "0.0; expected a finite number > 0"),
    ("attention.layer_norm_rms_epsilon", -1e-5, F64, "-1e-05; expected a finite number > 0"),
    ("rope.freq_base", float("inf"), F32, "inf; expected a finite number >= 1"),
    ("rope.freq_base", 1e300, F64, "1e[+]300; expected a finite number >= 1"),
    ("rope.freq_base", 0.0, F32, "0.0; expected a finite number >= 1"),
    ("attention.head_count_kv", np.array([], np.uint32), (ValueType.ARRAY, U32), "an array of 0 uint32"),
    ("attention.head_count_kv", ["3", "3"], (ValueType.ARRAY, STR), "an array of strings; expected a number"),
    ("context_length", np.array([1.5, 1.5], np.float32), (ValueType.ARRAY, F32), "1.5; expected an integer"),
])
def test_metadata_of_the_wrong_type_or_range(edit, tmp_path, key, value, vtype, match):
    m = edit("llama")
    refused(m.set(f"llama.{key}", value, vtype), tmp_path / "m.gguf", re.escape(f"llama.{key} is ") + match)


def test_per_layer_arrays(edit, loader, tmp_path):
    m = edit("smollm2")
    path = m.set("llama.attention.head_count_kv", np.array([3, 3], np.uint32)).write(tmp_path / "equal.gguf")
    assert loader.load(path) == {"outcome": "ok"}  # one value per layer, all equal: as the scalar
    m.set("llama.attention.head_count_kv", np.array([3, 1], np.uint32))
    refused(m, tmp_path / "m.gguf", "head_count_kv differs between layers", UnsupportedModelError)


@pytest.mark.parametrize("key, value, match", [
    ("rope.scaling.type", "yarn", "rope.scaling.type 'yarn' is not supported"),
    ("attention.value_length", 32, "value_length = 32 differs from the key length 64"),
])
def test_unsupported_features(edit, tmp_path, key, value, match):
    m = edit("smollm2")
    refused(m.set(f"llama.{key}", value), tmp_path / "m.gguf", match, UnsupportedModelError)


@pytest.mark.parametrize("name, type_name", [("blk.0.attn_k.weight", "IQ4_NL"), ("token_embd.weight", "I32"),
                                             ("output_norm.weight", "I8"), ("blk.1.ffn_down.weight", "Q8_1")])
def test_tensor_types_the_backends_cannot_compute_with(edit, tmp_path, name, type_name):
    m = edit("llama")
    msg = refused(m.retensor(name, type=type_name), tmp_path / "m.gguf", f"tensor '{name}' is stored as "
                  f"{type_name}, which quanta cannot compute with", UnsupportedModelError)
    assert "Q4_K" in msg  # the supported list


@pytest.mark.parametrize("name, shape, match", [
    ("blk.0.ffn_down.weight", (512, 256), r"ffn_down.weight' has shape \(512, 256\); expected \(256, 512\)"),
    ("blk.1.attn_q.weight", (1, 512, 256), r"expected \(512, 256\) \(head_count × key_length × embedding_length\)"),
    ("output_norm.weight", (1, 256), r"has shape \(1, 256\); expected \(256,\)"),
    ("token_embd.weight", (512 * 256,), r"token_embd.weight' has shape \(131072,\); expected a matrix"),
    ("blk.0.attn_k_norm.weight", (256,), r"attn_k_norm.weight' has shape \(256,\); expected \(128,\) \(key_length\)"),
])
def test_tensor_shapes_that_contradict_the_config(edit, tmp_path, name, shape, match):
    m = edit("gemma3")
    refused(m.retensor(name, shape=shape), tmp_path / "m.gguf", match)


def test_missing_tensors(edit, tmp_path):
    m = edit("qwen2")
    del m.tensors[m.index("blk.1.attn_v.bias")]
    refused(m, tmp_path / "m.gguf", "the qwen2 model lacks tensor 'blk.1.attn_v.bias'")


def test_vocabulary_rows_against_the_tokenizer(edit, tmp_path):
    m = edit("smollm2")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        m.metadata[key] = m.metadata[key][:-1]
    refused(m, tmp_path / "m.gguf", r"tokenizer has 49151 tokens \(tokenizer.ggml.tokens\), but token_embd.weight "
            "has 49152 rows")


def test_rope_frequency_divisors(edit, tmp_path):
    def divisors(value: float) -> Tensor:  # one per rotated pair: head size 64
        return Tensor("rope_freqs.weight", "F32", (32,), np.full(32, value, np.float32).view(np.uint8))

    m = edit("llama")
    m.tensors.insert(1, divisors(1.0))
    load(m, tmp_path / "ok.gguf")
    m.tensors[1] = divisors(0.0)
    refused(m, tmp_path / "m.gguf", "rope_freqs.weight' holds zero")
    refused(m.retensor("rope_freqs.weight", shape=(64,)), tmp_path / "m.gguf", r"expected \(32,\)")


@pytest.mark.parametrize("value", [None, 0, "", b"x", [1], 2**200, -(2**200), float("nan"), np.float64(np.inf),
                                   np.array([0], np.int32), np.array([True])])
def test_from_metadata_turns_any_value_into_a_gguf_error(models, value):
    """Direct calls, values the reader can produce and some it cannot: never TypeError, OverflowError, ValueError."""
    md = dict(models["smollm2"].metadata)
    for key in ("llama.block_count", "llama.rope.freq_base", "llama.attention.head_count", "general.architecture"):
        bad = {**md, key: value} if value is not None else {k: v for k, v in md.items() if k != key}
        if key == "llama.rope.freq_base" and value is None:
            continue  # optional: the default applies
        with pytest.raises(GGUFError, match=key):
            ModelConfig.from_metadata(bad, 49152)


def _shrunk_last(m: Model, name: str) -> Model:
    m.tensors.append(m.tensors.pop(m.index(name)))
    return m.retensor(name, shape=(64,))


LLAMA_CPP_REFUSES = {  # edits of SmolLM2 that llama.cpp, an independent loader, refuses as well
    "rope wider than the head": lambda m: m.set("llama.rope.dimension_count", 128),
    "short norm weight": lambda m: _shrunk_last(m, "output_norm.weight"),
    "more layers than tensors": lambda m: m.set("llama.block_count", 3),
    "kv heads against attn_k": lambda m: m.set("llama.attention.head_count_kv", 9),
    "ffn length against the ffn tensors": lambda m: m.set("llama.feed_forward_length", 1024),
    "context length as a string": lambda m: m.set("llama.context_length", "8192", STR),
    "tokens against the embedding": lambda m: m.set("tokenizer.ggml.tokens", m.metadata["tokenizer.ggml.tokens"][:-1])
    .set("tokenizer.ggml.token_type", m.metadata["tokenizer.ggml.token_type"][:-1]),
}


def _llama_cpp_loads(path) -> bool:
    """Whether llama.cpp (llama-cpp-python) loads the file, in a process of its own (it may abort on bad files)."""
    import subprocess
    import sys

    code = "import sys; from llama_cpp import Llama; Llama(sys.argv[1], n_ctx=32, n_threads=1, verbose=False)"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=300).returncode == 0


def test_llama_cpp_refuses_what_we_refuse(edit, tmp_path):
    pytest.importorskip("llama_cpp")
    assert _llama_cpp_loads(edit("smollm2").write(tmp_path / "unedited.gguf"))
    for what, change in LLAMA_CPP_REFUSES.items():
        path = tmp_path / "m.gguf"
        refused(change(edit("smollm2")), path, None)
        assert not _llama_cpp_loads(path), what
