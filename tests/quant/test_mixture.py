"""Mixture rules against llama.cpp itself: the real llama.cpp-made files, and llama_model_quantize's choices."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from quanta.gguf import open_gguf
from quanta.quant.mixture import FILE_TYPES, file_type_id, plan_types, use_more_bits
from quanta.synth import get_preset, synthesize

QUANTIZE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "F16", "BF16"]


def _mismatches(path, file_type, n_layers=None):
    with open_gguf(path) as f:
        n_layers = n_layers or f.metadata[f"{f.architecture}.block_count"]
        plan = plan_types(file_type, [(n, t.shape) for n, t in f.tensors.items()], n_layers)
        return [(n, t.type, plan[n]) for n, t in f.tensors.items() if (plan[n] or t.type) != t.type]


@pytest.mark.parametrize("model,file_type", [("smollm2_path", "Q4_1"), ("gemma3_path", "Q4_K_M")])
def test_plan_reproduces_the_real_llama_cpp_files(model, file_type, request):
    path = request.getfixturevalue(model)
    with open_gguf(path) as f:
        assert f.metadata["general.file_type"] == file_type_id(file_type)
    assert _mismatches(path, file_type) == []


def test_file_type_ids_are_llama_cpps():
    import llama_cpp

    for name, ftype in [("Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0"), ("Q4_K_M", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
                        ("Q5_K_M", "LLAMA_FTYPE_MOSTLY_Q5_K_M"), ("Q4_K_S", "LLAMA_FTYPE_MOSTLY_Q4_K_S"),
                        ("Q6_K", "LLAMA_FTYPE_MOSTLY_Q6_K"), ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
                        ("F16", "LLAMA_FTYPE_MOSTLY_F16"), ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"),
                        ("Q5_1", "LLAMA_FTYPE_MOSTLY_Q5_1"), ("Q2_K", "LLAMA_FTYPE_MOSTLY_Q2_K")]:
        assert file_type_id(name) == getattr(llama_cpp, ftype)


def test_use_more_bits_layers():
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


# small variants: 256-wide rows (every K-quant fits), 640-wide (Gemma-3: fallbacks), biases (Qwen2)
SMALL = {
    "llama": dataclasses.replace(get_preset("llama-3.2-1b"), n_layers=9, n_embd=256, n_ff=512, n_head=4,
                                 n_head_kv=1, vocab_size=1024),
    "llama-untied": dataclasses.replace(get_preset("tinyllama-1.1b"), n_layers=8, n_embd=512, n_ff=768, n_head=8,
                                        n_head_kv=2, vocab_size=1024),
    "gemma3": get_preset("gemma3-270m").with_overrides(layers=9, vocab=1024),
}


@pytest.fixture(scope="module")
def f16_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    out = {}
    for key, p in SMALL.items():
        synthesize(p, d / f"{key}.gguf", "F16", progress=False)
        out[key] = d / f"{key}.gguf"
    return out


@pytest.mark.parametrize("file_type", QUANTIZE_TYPES)
@pytest.mark.parametrize("model", list(SMALL))
def test_plan_equals_llama_model_quantize(f16_models, tmp_path, model, file_type):
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type_id(file_type)
    params.nthread = 2
    out = tmp_path / "q.gguf"
    assert llama_cpp.llama_model_quantize(str(f16_models[model]).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    assert _mismatches(out, file_type) == []
    with open_gguf(out) as f:
        types = {t.type for t in f.tensors.values()}
    if file_type == "Q4_K_M" and model != "gemma3":
        assert {"Q4_K", "Q6_K"} <= types  # the rules did something


def test_unknown_file_type():
    with pytest.raises(ValueError, match="unknown file type"):
        plan_types("Q7_X", [])
    assert set(QUANTIZE_TYPES) <= set(FILE_TYPES)
