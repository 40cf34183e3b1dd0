"""`quanta run`: streams a completion, applies the chat template unless --raw, prints --stats to stderr."""

from __future__ import annotations

import io

import pytest

from quanta.cli.main import main


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from quanta.api import LLM

    return LLM(smollm2_path, n_ctx=256)


def test_run_raw_matches_api(smollm2_path, llm, capsys):
    rc = main(["run", "-m", str(smollm2_path), "--raw", "--temperature", "0", "--max-tokens", "8", "The sky is"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = llm.generate("The sky is", max_tokens=8, temperature=0).text
    assert out == expected + "\n"


def test_run_chat_template_and_stats(smollm2_path, llm, capsys):
    rc = main(["run", "-m", str(smollm2_path), "--temperature", "0", "--max-tokens", "8", "--stats",
               "--system", "Answer briefly.", "What is the capital of France?"])
    captured = capsys.readouterr()
    assert rc == 0
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]
    assert captured.out == llm.chat(msgs, max_tokens=8, temperature=0).text + "\n"
    assert "TTFT" in captured.err and "decode" in captured.err and "tok/s" in captured.err


def test_run_reads_stdin(smollm2_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    assert main(["run", "-m", str(smollm2_path), "--raw", "--max-tokens", "3", "--seed", "1", "-"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1", "hi"], "temperature"),
    (["--raw", "--system", "x", "hi"], "--system"),
    (["--top-p", "3", "hi"], "top_p"),
])
def test_run_user_errors(smollm2_path, capsys, args, message):
    assert main(["run", "-m", str(smollm2_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quanta: error:") and message in err and "Traceback" not in err


def test_unknown_model(capsys):
    assert main(["run", "-m", "no-such-model", "hi"]) == 2
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["run", "hi"], ["bench", "-p", "8", "-n", "2", "--repeats", "1"]])
def test_device_cuda_without_a_gpu_is_a_clear_error(smollm2_path, capsys, verb):
    """Both the generator and the benchmark (which probes the GPU's bandwidth before it loads the model)."""
    if pytest.importorskip("torch").cuda.is_available():
        pytest.skip("a GPU is present")
    assert main([verb[0], "-m", str(smollm2_path), "--device", "cuda", *verb[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quanta: error: --device cuda needs an NVIDIA GPU") and "Traceback" not in err


def test_a_context_larger_than_memory_is_a_clear_error(smollm2_path, capsys):
    """Before: the rotary table of 10^9 positions was allocated first and the OOM killer ended the process."""
    assert main(["run", "-m", str(smollm2_path), "--n-ctx", "1000000000", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quanta: error: n_ctx 1,000,000,000 needs") and "Traceback" not in err
