"""Compiling ahead (backends/cuda/compile_ahead.py) on a GPU: in a fresh process with an empty Triton cache, the
dry runs before each new shape's first forward compile every kernel the forwards launch and the sampled draw's
(none of them compiles at its launch; the greedy argmax, outside the forward, still does), and the tokens are
those of a process that compiles each kernel as it is launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from quanta.synth import get_preset, synthesize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a GPU (nothing to compile "
                                "under the interpreter)")

# counts the kernels compiled at a launch (a miss outside a warm-up), then generates greedily
SCRIPT = r"""
import json, sys
from triton import knobs
from quanta import LLM

at_launch = []
def count(**kw):
    if not kw.get("is_manual_warmup", kw["compile"].get("is_warmup", False)):
        at_launch.append(kw["fn"].module)
knobs.runtime.jit_cache_hook = count
llm = LLM(sys.argv[1], device="cuda", cuda={"compile_ahead": sys.argv[2] == "on"})
out = [llm.generate([3, 17, 5, 60, 2, 9, 33, 41, 7], max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
       for _ in range(3)]
out.append(llm.generate([3, 17, 5], max_tokens=8, seed=1, ignore_eos=True).token_ids)  # sampled: top-k 40
print("RESULT", json.dumps({"tokens": out, "at_launch": at_launch}))
"""


def _run(model: Path, mode: str, cache: Path) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    src = str(Path(__file__).parents[3] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model), mode], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1])


def test_dry_runs_compile_every_kernel_and_change_no_token(tmp_path: Path) -> None:
    preset = replace(get_preset("tinyllama-1.1b"), n_layers=2, n_embd=256, n_ff=512, n_head=8, n_head_kv=4,
                     vocab_size=512)
    model = tmp_path / "tiny.gguf"
    synthesize(preset, model, "Q4_K_M", std=0.1, progress=False)  # Q4_K and Q6_K matrices
    ahead = _run(model, "on", tmp_path / "cache_on")
    lazy = _run(model, "off", tmp_path / "cache_off")
    outside_forward = {"quanta.backends.cuda.sampling"}
    assert set(lazy["at_launch"]) - outside_forward, "the count sees the forward's kernels compiled at their launch"
    assert "quanta.backends.cuda.draw" in lazy["at_launch"]  # the sampled draw's kernels, compiled ahead too
    assert set(ahead["at_launch"]) <= outside_forward
    assert ahead["tokens"] == lazy["tokens"]
    assert ahead["tokens"][0] == ahead["tokens"][1] == ahead["tokens"][2]
