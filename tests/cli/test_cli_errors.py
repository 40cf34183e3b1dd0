"""~100 user mistakes with the CLI: each ends with exit status 2 and one line on stderr, never a traceback.

Every invocation runs through the real entry point (``quanta.cli.main.main``) in this process, with stdin holding
one chat message (so `quanta chat` reaches its first turn); the files it is pointed at are made here: a tiny
synthetic model, a directory, a FIFO, a text file, a truncated GGUF, an empty file.
"""

from __future__ import annotations

import io
import os

import pytest

from quanta.cli.main import main
from quanta.synth import get_preset, synthesize

PRESET = "qwen2.5-0.5b"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-errors")
    model = root / "tiny.gguf"
    synthesize(get_preset(PRESET).with_overrides(layers=1, vocab=1024), model, "Q8_0", progress=False)
    (root / "dir").mkdir()
    os.mkfifo(root / "fifo")
    (root / "text.gguf").write_text("not a model\n")
    (root / "empty.gguf").write_bytes(b"")
    (root / "truncated.gguf").write_bytes(model.read_bytes()[:1000])
    (root / "home-file").write_text("")
    return {"MODEL": str(model), "DIR": str(root / "dir"), "FIFO": str(root / "fifo"), "TEXT": str(root / "text.gguf"),
            "EMPTY": str(root / "empty.gguf"), "TRUNC": str(root / "truncated.gguf"), "OUT": str(root / "out.gguf"),
            "NOWHERE": str(root / "missing" / "out.gguf"), "MISSING": str(root / "missing.gguf"),
            "HOMEFILE": str(root / "home-file")}


SYNTH = ["synth", PRESET, "OUT", "--type", "Q8_0"]
QUANT = ["quantize", "MODEL", "OUT", "--type", "Q8_0"]
CHAT = ["chat", "-m", "MODEL", "--max-tokens", "2"]

MISTAKES: list[tuple[list[str], dict[str, str]]] = [(argv, {}) for argv in [
    [], ["nosuch"], ["--nosuch"], ["-m", "MODEL"], ["run", "--threads", "abc"], ["bench", "-p", "abc"],
    ["inspect"], ["inspect", "MODEL", "--tensors", "x"], ["list", "extra"], ["list", "--nosuch"],
    ["pull"], ["pull", "gpt-17"], ["pull", "smollm2-135m", "gemma3-270m"], ["pull", "--force"],
    ["pull", "smollm2-135m", "--nosuch"],
    # synth
    ["synth"], ["synth", PRESET], ["synth", "nosuch", "OUT", "--type", "Q8_0"], ["synth", PRESET, "OUT"],
    ["synth", PRESET, "OUT", "--type", "Q9_9"], ["synth", PRESET, "OUT", "--type", "q8_0"],
    SYNTH + ["--layers", "0"], SYNTH + ["--layers", "-1"], SYNTH + ["--layers", "abc"], SYNTH + ["--layers", "1e3"],
    SYNTH + ["--layers", "100000"], SYNTH + ["--vocab", "0"], SYNTH + ["--vocab", "-5"], SYNTH + ["--vocab", "10"],
    SYNTH + ["--vocab", "1000000000000"], SYNTH + ["--vocab", "abc"], SYNTH + ["--vocab", "1.5"],
    SYNTH + ["--seed", "-1"], SYNTH + ["--seed", "abc"], SYNTH + ["--nosuch"], SYNTH + ["extra"],
    ["synth", PRESET, "DIR", "--type", "Q8_0", "--layers", "1"], ["synth", PRESET, "FIFO", "--type", "Q8_0"],
    ["synth", PRESET, "/dev/null", "--type", "Q8_0"], ["synth", PRESET, "NOWHERE", "--type", "Q8_0"],
    ["synth", PRESET, "", "--type", "Q8_0"],
    # quantize
    ["quantize"], ["quantize", "MODEL"], ["quantize", "MODEL", "OUT"], QUANT[:4] + ["Q3_K_XL"],
    QUANT[:4] + ["q4_0"], QUANT + ["extra"], ["quantize", "MISSING", "OUT", "--type", "Q8_0"],
    ["quantize", "DIR", "OUT", "--type", "Q8_0"], ["quantize", "TEXT", "OUT", "--type", "Q8_0"],
    ["quantize", "EMPTY", "OUT", "--type", "Q8_0"], ["quantize", "TRUNC", "OUT", "--type", "Q8_0"],
    ["quantize", "FIFO", "OUT", "--type", "Q8_0"], ["quantize", "gpt-17", "OUT", "--type", "Q8_0"],
    ["quantize", "MODEL", "DIR", "--type", "Q8_0"], ["quantize", "MODEL", "FIFO", "--type", "Q8_0"],
    ["quantize", "MODEL", "/dev/null", "--type", "Q8_0"], ["quantize", "MODEL", "NOWHERE", "--type", "Q8_0"],
    ["quantize", "MODEL", "MODEL", "--type", "Q8_0"], ["quantize", "MODEL", "", "--type", "Q8_0"],
    # chat
    ["chat", "-m", "MISSING"], ["chat", "-m", "DIR"], ["chat", "-m", "gpt-17"], ["chat", "-m", "TEXT"],
    ["chat", "-m", "EMPTY"], ["chat", "-m", "TRUNC"], ["chat", "-m", "FIFO"], ["chat", "-m"],
    CHAT + ["--n-ctx", "abc"], CHAT + ["--n-ctx", "1"], CHAT + ["--n-ctx", "0"], CHAT + ["--n-ctx", "-5"],
    CHAT + ["--n-ctx", "1000000000"], CHAT + ["--threads", "abc"], CHAT + ["--threads", "0"],
    CHAT + ["--threads", "-1"], CHAT + ["--device", "gpu9"], CHAT + ["--device", "cuda:abc"],
    CHAT + ["--device", ""], CHAT + ["--temperature", "abc"], CHAT + ["--temperature", "-1"],
    CHAT + ["--temperature", "nan"], CHAT + ["--top-k", "-1"], CHAT + ["--top-k", "abc"], CHAT + ["--top-p", "2"],
    CHAT + ["--top-p", "-0.5"], CHAT + ["--min-p", "-1"], CHAT + ["--min-p", "2"], CHAT + ["--max-tokens", "-1"],
    CHAT + ["--max-tokens", "abc"], CHAT + ["--repeat-penalty", "0"], CHAT + ["--repeat-penalty", "-1"],
    CHAT + ["--repeat-penalty", "1e-30"], CHAT + ["--seed", "-1"], CHAT + ["--seed", "abc"], CHAT + ["--system"],
    CHAT + ["--nosuch"], CHAT + ["--tensor-parallel", "0"], CHAT + ["--tensor-parallel", "abc"],
    CHAT + ["--tensor-parallel", "2", "--device", "cpu"], ["run", "-m", "MODEL", "--tensor-parallel", "-1", "hi"],
    ["bench", "-m", "MODEL", "--empty-kernel-cache"],
    ["bench", "-m", "MODEL", "--empty-kernel-cache", "--no-cold-start"],
]] + [
    (["list"], {"QUANTA_HOME": "HOMEFILE"}), (["pull", "smollm2-135m"], {"QUANTA_HOME": "HOMEFILE"}),
    (["chat", "-m", "MODEL"], {"QUANTA_HOME": "HOMEFILE"}), (["pull", "smollm2-135m"], {"QUANTA_HOME": "/sys"}),
    (["quantize", "smollm2-135m", "OUT", "--type", "Q8_0"], {"QUANTA_HOME": "/sys"}),
]


def _run(argv: list[str], env: dict[str, str], files: dict[str, str], monkeypatch, capsys) -> tuple[int, str]:
    for key, value in env.items():
        monkeypatch.setenv(key, files.get(value, value))
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    status = main([files.get(arg, arg) for arg in argv])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("argv,env", MISTAKES, ids=[" ".join(a) + (f" {e}" if e else "") for a, e in MISTAKES])
def test_a_mistake_is_one_line_and_status_2(argv, env, files, monkeypatch, capsys):
    status, err = _run(argv, env, files, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    verb = argv[0] if argv and not argv[0].startswith("-") and argv[0] in {"run", "bench", "inspect", "list",
                                                                            "pull", "synth", "quantize", "chat"} else ""
    assert lines[0].startswith(("quanta: error: ", f"quanta {verb}: error: ")), err
    assert not os.path.exists(files["OUT"]) and not os.path.exists(files["OUT"] + ".part")
