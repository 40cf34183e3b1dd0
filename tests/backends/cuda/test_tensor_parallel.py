"""Tensor parallelism against one rank: the same model split over two processes (gloo collectives; under the
Triton interpreter on CPU tensors, or both ranks on one GPU) gives TP=1's logits within float tolerance, and in
exact mode the same greedy tokens through the batched engine."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from quanta import gguf
from quanta.backends.cuda import CUDABackend
from quanta.engine import LLMEngine, SamplingParams, StopConditions
from quanta.engine.config import EngineConfig
from quanta.engine.model_runner import ModelRunner
from quanta.errors import QuantaError
from quanta.models import load_model
from quanta.parallel.launch import GroupSpec, LeadRank
from quanta.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import write_tiny_model  # noqa: E402

IDS = [3, 17, 5, 60, 2, 9, 33, 41, 7, 7, 12]


def few_programs_in_followers() -> None:
    """The few_programs fixture's GEMV tiles in a follower's process (under the interpreter only)."""
    if torch.cuda.is_available():
        return
    from quanta.backends.cuda import q8gemv, qmatmul

    for table in (qmatmul.GEMV_CONFIG, q8gemv.Q8_CONFIG):
        for key in list(table):
            table[key] = {"BN": 32, "BJ": 8, "num_warps": 1}


def _group(path: Path, device: str, exact: bool, n_ctx: int = 64) -> LeadRank:
    return LeadRank(GroupSpec(str(path), (device, device), n_ctx, {"exact": exact}, "gloo",
                              init=few_programs_in_followers))


@pytest.mark.parametrize("arch,exact", [("llama", True), ("qwen2", True), ("gemma3", True), ("llama", False)])
def test_two_ranks_give_one_ranks_logits(arch: str, exact: bool, tmp_path: Path, device: str,
                                         few_programs: None) -> None:
    """Teacher-forced logits of a prompt: a prefill chunk, then decode rows (the fast mode: a shorter prompt)."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch)
    ids = IDS if exact else IDS[:6]
    config = EngineConfig(max_seqs=2, kv_blocks=8).resolved("cuda")

    def logits(runner: ModelRunner) -> np.ndarray:
        return np.concatenate([runner.score(ids[:4], [0, 1], 4), runner.score(ids, [2, 3], 1)[4:]])

    backend = CUDABackend(device, exact=exact, graphs=False)
    want = logits(ModelRunner(load_model(gguf.open(path), backend, 64), backend, config, 64))
    lead = _group(path, device, exact)
    try:
        two = ModelRunner(lead.model, lead.backend, lead.engine_config(EngineConfig(max_seqs=2, kv_blocks=8)), 64)
        assert two.cache.shape.n_kv_heads == 1 and lead.model.config.n_heads == 2  # half the heads each
        got = logits(two)
    finally:
        lead.close()
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=(1e-5 if exact else 2e-2) * scale)
    assert (got.argmax(1) == want.argmax(1)).all()


def _synth_uneven(path: Path) -> Path:
    """A model with a tokenizer whose FFN width, three blocks of 32, splits unevenly: 64 and 32 columns."""
    from quanta.synth import get_preset, synthesize

    preset = replace(get_preset("smollm2-135m"), n_layers=2, n_embd=64, n_ff=96, n_head=4, n_head_kv=2,
                     vocab_size=512)
    synthesize(preset, path, "Q8_0", std=0.1, progress=False)
    return path


def _greedy(model, backend, config: EngineConfig, path: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(model, backend, load_tokenizer(gguf.open(path)), config, 64)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0), StopConditions(max_tokens=6, ignore_eos=True))
           for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for r in engine.step():
            out[r.request_id].extend(r.new_token_ids)
    return [out[i] for i in ids]


def test_exact_greedy_tokens_equal_one_ranks_in_the_batched_engine(tmp_path: Path, device: str,
                                                                   few_programs: None) -> None:
    path = _synth_uneven(tmp_path / "uneven.gguf")
    prompts = [[5, 9, 100, 200, 7], [11, 12, 13], [300, 301, 302, 303, 304, 305, 306, 307, 308]]
    config = EngineConfig(max_seqs=3, kv_blocks=16)
    backend = CUDABackend(device, exact=True, graphs=False)
    want = _greedy(load_model(gguf.open(path), backend, 64), backend, config, path, prompts)
    lead = _group(path, device, exact=True)
    try:
        assert lead.model.config.d_ff == 64  # rank 0's share of the uneven split
        got = _greedy(lead.model, lead.backend, lead.engine_config(config), path, prompts)
    finally:
        lead.close()
    assert got == want
    assert all(len(t) == 6 for t in got)


def test_a_model_that_does_not_split_is_a_clear_error(tmp_path: Path, device: str) -> None:
    path = write_tiny_model(tmp_path / "three.gguf", n_heads=3, n_kv_heads=1, head_dim=32)
    with pytest.raises(QuantaError, match=r"attention heads \(3\) to divide by 2"):
        _group(path, device, exact=True)
