"""`convert_file`: types follow the mixture, bytes match gguf-py's quantizer, output runs in llama.cpp."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from quanta.gguf import open_gguf
from quanta.quant.convert import convert_file
from quanta.quant.mixture import file_type_id, plan_types
from quanta.synth import get_preset, synthesize

GGUF_PY_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "f32.gguf"
    synthesize(get_preset("gemma3-270m").with_overrides(layers=3, vocab=512), path, "F32", progress=False)
    return path


@pytest.mark.parametrize("file_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K",
                                       "F16", "BF16"])
def test_convert_follows_the_plan_and_gguf_py(f32_model, tmp_path, file_type):
    out = tmp_path / "out.gguf"
    written = convert_file(f32_model, out, file_type, progress=False)
    with open_gguf(f32_model) as src, open_gguf(out) as dst:
        plan = plan_types(file_type, [(n, t.shape) for n, t in src.tensors.items()], 3)
        assert dst.metadata["general.file_type"] == file_type_id(file_type)
        assert list(dst.metadata) == list(src.metadata)
        for key, value in src.metadata.items():
            if key != "general.file_type":
                assert np.array_equal(dst.metadata[key], value), key
        for name, t in src.tensors.items():
            new = dst.tensors[name]
            assert new.type == (plan[name] or "F32") == written[name] and new.shape == t.shape
            x = t.raw.view(np.float32).reshape(t.shape)
            if new.type in GGUF_PY_QUANTIZES:
                expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType[new.type])
                assert np.array_equal(new.raw, expected.view(np.uint8).reshape(-1)), name
            else:
                w = gguf.quants.dequantize(new.raw.reshape(t.shape[0], -1), gguf.GGMLQuantizationType[new.type])
                rel = np.sqrt(np.mean((w - x) ** 2)) / np.sqrt(np.mean(x**2))
                assert rel < 0.15, (name, new.type, rel)


@pytest.fixture(scope="module")
def llama_logits():
    llama_cpp = pytest.importorskip("llama_cpp")

    def logits(path) -> np.ndarray:
        llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False, logits_all=True)
        llm.eval(llm.tokenize(b"The capital of France is Paris. The capital of Germany is"))
        out = np.array(llm.scores[: llm.n_tokens])
        llm.close()
        return out

    return logits


@pytest.mark.parametrize("file_type,min_corr", [("Q8_0", 0.99), ("Q4_K_M", 0.9)])
def test_converted_real_model_runs_in_llama_cpp(smollm2_path, tmp_path, llama_logits, file_type, min_corr):
    out = tmp_path / f"smollm2-{file_type}.gguf"
    convert_file(smollm2_path, out, file_type, progress=False)
    ref, got = llama_logits(smollm2_path), llama_logits(out)
    assert got.shape == ref.shape and np.isfinite(got).all()
    corr = np.corrcoef(ref[-1], got[-1])[0, 1]
    top1 = np.mean(ref.argmax(-1) == got.argmax(-1))
    print(f"\n{file_type}: last-position logit correlation {corr:.4f}, top-1 agreement {top1:.2f}")
    assert corr > min_corr and top1 >= 0.7


def test_same_type_is_copied_byte_for_byte(smollm2_path, tmp_path):
    out = tmp_path / "same.gguf"
    convert_file(smollm2_path, out, "Q4_1", progress=False)
    with open_gguf(smollm2_path) as a, open_gguf(out) as b:
        for name, t in a.tensors.items():
            assert np.array_equal(t.raw, b.tensors[name].raw)


def test_refuses_to_overwrite_its_input(smollm2_path):
    with pytest.raises(ValueError, match="must differ"):
        convert_file(smollm2_path, smollm2_path, "Q8_0", progress=False)
