"""The shard plan: each rank's part of every tensor, checked by dequantizing with gguf-py (the oracle) and
joining the parts back into the whole tensor; the shapes that cannot split fail clearly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest

from quanta import gguf
from quanta.errors import QuantaError
from quanta.models import model_config
from quanta.parallel.shard import ShardPlan, even_range
from quanta.synth import get_preset, synthesize


def _values(t: gguf.TensorInfo) -> np.ndarray:
    return gguf_py.quants.dequantize(np.asarray(t.raw).reshape(t.shape[0], -1),
                                     gguf_py.GGMLQuantizationType[t.type]).reshape(t.shape)


@pytest.mark.parametrize("n,parts,unit", [(12, 2, 1), (11008, 2, 256), (11008, 4, 256), (96, 3, 32), (7, 3, 1)])
def test_even_ranges_tile_the_whole_in_units(n: int, parts: int, unit: int) -> None:
    spans = [even_range(n, parts, r, unit) for r in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(start % unit == 0 and stop % unit == 0 for start, stop in spans)
    sizes = [stop - start for start, stop in spans]
    assert max(sizes) - min(sizes) <= unit


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q4_K_M mix (Q6_K and Q4_K matrices) whose FFN width, 768, is three super-blocks: an uneven split at
    TP=2."""
    path = tmp_path_factory.mktemp("tp") / "q4km.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=2, n_embd=512, n_ff=768, n_head=4, n_head_kv=2,
                     vocab_size=512)
    synthesize(preset, path, "Q4_K_M", progress=False)
    return path


def test_the_parts_join_into_every_tensor(kquant_model: Path) -> None:
    with gguf.open(kquant_model) as f:
        config = model_config(f)
        plans = [ShardPlan.build(config, f.tensors, r, 2) for r in range(2)]
        assert [p.ffn for p in plans] == [(0, 512), (512, 768)]
        assert [p.local_config(config).n_heads for p in plans] == [2, 2]
        for t in f.tensors.values():
            whole = _values(t)
            parts = [_values(p.tensor(t)) for p in plans]
            kind = t.name.split(".")[-2]
            axis = 1 if kind in ("attn_output", "ffn_down") else 0
            if kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                np.testing.assert_array_equal(np.concatenate(parts, axis=axis), whole, err_msg=t.name)
                assert all(part.shape[axis] < whole.shape[axis] for part in parts)
            else:  # norms and the embedding stay whole
                assert all(np.array_equal(part, whole) for part in parts), t.name
        head = f.tensors.get("output.weight", f.tensors["token_embd.weight"])
        np.testing.assert_array_equal(np.concatenate([_values(p.lm_head(head)) for p in plans]), _values(head))


def test_heads_that_do_not_divide_are_refused(kquant_model: Path) -> None:
    with gguf.open(kquant_model) as f:
        config = model_config(f)
        with pytest.raises(QuantaError, match=r"attention heads \(4\) to divide by 3"):
            ShardPlan.build(config, f.tensors, 0, 3)
        with pytest.raises(QuantaError, match=r"key/value heads \(2\) to divide by 4"):
            ShardPlan.build(config, f.tensors, 0, 4)
        with pytest.raises(QuantaError, match="fewer than the 4 ranks"):
            ShardPlan.build(replace(config, n_kv_heads=4), f.tensors, 0, 4)


def test_a_column_split_inside_a_block_is_refused(tmp_path: Path) -> None:
    """Two heads of 64 are 128 columns of attn_output: half a Q4_K super-block."""
    path = tmp_path / "narrow.gguf"
    preset = replace(get_preset("smollm2-135m"), n_layers=1, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                     vocab_size=512)
    synthesize(preset, path, "Q4_K_S", progress=False)
    with gguf.open(path) as f:
        with pytest.raises(QuantaError, match="cannot be split at columns 0..128"):
            ShardPlan.build(model_config(f), f.tensors, 0, 2)
