"""The model-file verbs through the real `quanta` entry point: pull, list, inspect, quantize, synth."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

from quanta.cli import main as cli
from quanta.gguf import open_gguf
from quanta.hub import KNOWN_MODELS


@pytest.fixture
def quanta(capsys):
    """Run `quanta ARGS...` in-process; returns (status, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as e:  # argparse errors
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


def test_pull_of_a_cached_model_is_a_no_op(quanta, smollm2_path, monkeypatch):
    monkeypatch.setenv("QUANTA_HOME", str(smollm2_path.parent.parent))
    status, out, _ = quanta("pull", "smollm2-135m")
    assert status == 0 and "already in the cache" in out and str(smollm2_path) in out


def test_pull_rejects_unknown_names(quanta):
    status, _, err = quanta("pull", "gpt-17")
    assert status == 2 and "smollm2-135m" in err


def test_list_shows_cached_models(quanta, smollm2_path, gemma3_path, monkeypatch):
    monkeypatch.setenv("QUANTA_HOME", str(smollm2_path.parent.parent))
    status, out, _ = quanta("list")
    assert status == 0
    for name, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma3_path)):
        line = next(l for l in out.splitlines() if l.startswith(name))
        assert str(path) in line and f"{path.stat().st_size / 2**20:.1f} MiB" in line
    status, out, _ = quanta("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["gemma3-270m"]["bytes"] == gemma3_path.stat().st_size


def test_list_of_an_empty_cache_says_how_to_pull(quanta, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTA_HOME", str(tmp_path))
    status, out, _ = quanta("list")
    assert status == 0 and "quanta pull" in out and all(n in out for n in KNOWN_MODELS)


@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_inspect_json_agrees_with_gguf_py(quanta, model, request):
    path = request.getfixturevalue(model)
    status, out, _ = quanta("inspect", str(path), "--json")
    assert status == 0
    d = json.loads(out)
    ref = gguf.GGUFReader(path)
    arch = ref.fields["general.architecture"].contents()
    assert d["architecture"] == arch
    assert d["hyperparameters"]["block_count"] == ref.fields[f"{arch}.block_count"].contents()
    assert d["tokenizer"]["vocab_size"] == len(ref.fields["tokenizer.ggml.tokens"].data)
    assert d["tokenizer"]["model"] == ref.fields["tokenizer.ggml.model"].contents()
    assert d["tokenizer"]["chat_template"] == ("tokenizer.chat_template" in ref.fields)
    assert [(t["name"], t["type"], t["bytes"]) for t in d["tensors"]] == [
        (t.name, t.tensor_type.name, int(t.n_bytes)) for t in ref.tensors]
    n_params = sum(int(t.n_elements) for t in ref.tensors)
    n_bytes = sum(int(t.n_bytes) for t in ref.tensors)
    assert d["totals"]["parameters"] == n_params and d["totals"]["bytes"] == n_bytes
    assert d["totals"]["bits_per_weight"] == pytest.approx(8 * n_bytes / n_params)
    for type_name, row in d["by_type"].items():
        assert row["bytes"] == sum(int(t.n_bytes) for t in ref.tensors if t.tensor_type.name == type_name)


def test_inspect_text_by_known_name(quanta, smollm2_path, monkeypatch):
    monkeypatch.setenv("QUANTA_HOME", str(smollm2_path.parent.parent))
    status, out, _ = quanta("inspect", "smollm2-135m", "--tensors", "3")
    assert status == 0
    assert "architecture: llama" in out and "tokenizer: gpt2" in out and "vocab 49152" in out
    assert "chat template: yes" in out and "token_embd.weight" in out and "... 269 more" in out
    assert "Q4_1" in out and "bits/weight" in out


def test_inspect_errors_are_one_line(quanta, tmp_path):
    status, _, err = quanta("inspect", "not-a-model")
    assert status == 2 and err.startswith("quanta: error:") and "gemma3-270m" in err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(40))
    status, _, err = quanta("inspect", str(bad))
    assert status == 2 and "unsupported GGUF version" in err and len(err.strip().splitlines()) == 1


def test_quantize_by_name(quanta, smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTA_HOME", str(smollm2_path.parent.parent))
    out = tmp_path / "s.gguf"
    status, stdout, _ = quanta("quantize", "smollm2-135m", str(out), "--type", "Q5_0")
    assert status == 0 and "Q5_0" in stdout
    ref = gguf.GGUFReader(out)
    assert int(ref.fields["general.file_type"].contents()) == 8
    kinds = {t.tensor_type.name for t in ref.tensors}
    assert kinds == {"Q5_0", "Q8_0", "F32"}  # token_embd (tied output) goes to Q8_0: 576 does not fit Q6_K


def test_quantize_rejects_unknown_types(quanta, tmp_path):
    status, _, err = quanta("quantize", "x.gguf", str(tmp_path / "y.gguf"), "--type", "Q3_K_XL")
    assert status == 2 and "invalid choice" in err


def test_synth_cli(quanta, tmp_path):
    out = tmp_path / "q.gguf"
    status, stdout, _ = quanta("synth", "qwen2.5-0.5b", str(out), "--type", "Q4_K_M", "--layers", "2",
                               "--vocab", "1000", "--seed", "3")
    assert status == 0 and "GB/s" in stdout
    with open_gguf(out) as f:
        assert f.architecture == "qwen2" and f.metadata["qwen2.block_count"] == 2
        assert f.tensors["token_embd.weight"].shape == (1000, 896)
        assert "blk.1.attn_q.bias" in f.tensors and "output.weight" not in f.tensors
        first = f.tensors["blk.0.ffn_up.weight"].raw.copy()
    status, _, _ = quanta("synth", "qwen2.5-0.5b", str(tmp_path / "r.gguf"), "--type", "Q4_K_M", "--layers", "2",
                          "--vocab", "1000", "--seed", "3")
    with open_gguf(tmp_path / "r.gguf") as f:
        assert np.array_equal(f.tensors["blk.0.ffn_up.weight"].raw, first)  # the seed makes it reproducible
    status, _, err = quanta("synth", "qwen2.5-0.5b", str(tmp_path / "t.gguf"), "--type", "Q4_K", "--vocab", "10")
    assert status == 2 and "too small" in err


def _quantize_process(src, out, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "quanta", "quantize", str(src), str(out), "--type", "Q8_0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.timeout(300)
def test_an_interrupted_quantize_leaves_no_partial_file(smollm2_path, tmp_path):
    out = tmp_path / "q8.gguf"
    partial = tmp_path / "q8.gguf.part"
    for _ in range(3):  # (on a loaded machine the 2-second quantize can finish before the interrupt lands: again)
        out.unlink(missing_ok=True)
        # Ctrl-C's default action in the child even where the suite runs in the background (a shell starts
        # background jobs with SIGINT ignored, and an ignored signal stays ignored across exec)
        proc = _quantize_process(smollm2_path, out, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while not (partial.exists() and partial.stat().st_size > 0) and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # Ctrl-C while the file is being written
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert not partial.exists() and not out.exists()


def _file_size_limit(n_bytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


@pytest.mark.timeout(300)
def test_a_quantize_that_runs_out_of_space_leaves_no_partial_file(smollm2_path, tmp_path):
    out = tmp_path / "q8.gguf"
    out.write_bytes(b"the previous file")
    proc = _quantize_process(smollm2_path, out, preexec_fn=_file_size_limit(8 << 20))  # writes fail past 8 MiB
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"quanta: error: [Errno 27] File too large while writing {out}"
    assert not (tmp_path / "q8.gguf.part").exists() and out.read_bytes() == b"the previous file"


def test_quantize_does_not_replace_a_fifo(quanta, smollm2_path, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    status, _, err = quanta("quantize", str(smollm2_path), str(fifo), "--type", "Q8_0")
    assert status == 2 and "not a regular file" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not (tmp_path / "fifo.part").exists()
