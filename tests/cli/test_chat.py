"""`quanta chat`: multi-turn history through the template, /reset, /exit, clean end of input."""

from __future__ import annotations

import io

from quanta.cli import chat
from quanta.cli.main import main


def run_chat(monkeypatch, capsys, path, lines):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = main(["chat", "-m", str(path), "--temperature", "0", "--max-tokens", "6"])
    return rc, capsys.readouterr()


def test_history_reset_and_exit(smollm2_path, monkeypatch, capsys):
    seen = []
    real = chat.answer

    def spy(llm, messages, kwargs):
        seen.append([m["role"] for m in messages])
        return real(llm, messages, kwargs)

    monkeypatch.setattr(chat, "answer", spy)
    rc, out = run_chat(monkeypatch, capsys, smollm2_path, ["Hi!", "How are you?", "/reset", "Bye.", "/exit", "x"])
    assert rc == 0
    assert seen == [["user"], ["user", "assistant", "user"], ["user"]]
    assert "reset" in out.err
    assert len(out.out.strip().splitlines()) >= 3


def test_end_of_input_exits_cleanly(smollm2_path, monkeypatch, capsys):
    rc, out = run_chat(monkeypatch, capsys, smollm2_path, [])
    assert rc == 0 and out.out == ""


def test_interrupt_stops_the_answer_not_the_program(smollm2_path, monkeypatch, capsys):
    from quanta.api import LLM

    llm = LLM(smollm2_path, n_ctx=256)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    expected = llm.chat(msgs, max_tokens=6, temperature=0).text
    llm.kv.reset()
    real_forward, calls = llm.backend.forward, []

    def interrupted_forward(*args, **kwargs):  # Ctrl-C arrives during the third forward (second decode step)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(llm.backend, "forward", interrupted_forward)
    text, result = chat.answer(llm, msgs, {"max_tokens": 6, "temperature": 0})
    assert result is None and expected.startswith(text)
    assert "[interrupted]" in capsys.readouterr().out
    monkeypatch.setattr(llm.backend, "forward", real_forward)
    llm.kv.reset()
    again, result = chat.answer(llm, msgs, {"max_tokens": 6, "temperature": 0})
    assert result is not None and again == expected
