"""Oracles for the model tests: HF transformers running the same GGUF in fp32 (it dequantizes with gguf-py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# A few hundred tokens of plain English for teacher-forced comparisons.
SAMPLE_TEXT = (
    "The river rises in the hills to the north of the town and runs for nearly forty miles before it reaches "
    "the sea. In the spring, when the snow melts, the water comes down fast and brown, carrying branches and "
    "stones, and the old stone bridge at the market square has more than once been closed for a week. The "
    "people who live along its banks have learned to read its moods. Farmers move their sheep to higher fields "
    "when the first heavy rains arrive, and the miller, whose family has worked the same wheel for six "
    "generations, keeps a notebook in which he records the height of the water every morning. His grandfather "
    "started the notebook in a dry summer when the river almost vanished, and since then not a single day has "
    "been missed. Scientists from the university sometimes visit to copy the figures, because no instrument "
    "in the region has such a long and careful record. They say the numbers show that floods have become more "
    "frequent over the last fifty years, and that the dry spells, though rarer, last longer than they used to. "
    "The miller is not surprised. He says the river has always been telling people what the weather will do; "
    "the only change is that more of them are now listening. In the evenings, children gather on the bridge to "
    "drop sticks on one side and race to the other to see which one appears first. Nobody remembers who "
    "invented the game, but everyone in the town has played it at least once."
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
]


def hf_model(path: Path, rope_parameters: dict | None = None):
    """The GGUF loaded by transformers in fp32. Its GGUF loader ignores ``rope_freqs.weight``: pass the
    model's Llama-3 rope scaling as ``rope_parameters`` to get the same frequencies from HF's own code."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                              dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    lg = logits[:-1].astype(np.float64)
    top = lg.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(lg - top).sum(axis=1)) + top[:, 0]
    return float(np.exp((log_z - lg[np.arange(len(ids) - 1), ids[1:]]).mean()))


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())
