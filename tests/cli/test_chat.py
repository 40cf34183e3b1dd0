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
    real = llm.stream_chat

    def interrupted(messages, **kwargs):  # Ctrl-C arrives while the third piece is being decoded
        stream = real(messages, **kwargs)

        def pieces():
            try:
                for i, piece in enumerate(stream):
                    if i == 2:
                        raise KeyboardInterrupt
                    yield piece
            finally:
                stream.close()

        return pieces()

    monkeypatch.setattr(llm, "stream_chat", interrupted)
    text, result = chat.answer(llm, msgs, {"max_tokens": 6, "temperature": 0})
    assert result is None and text and expected.startswith(text)
    assert "[interrupted]" in capsys.readouterr().out
    monkeypatch.undo()
    again, result = chat.answer(llm, msgs, {"max_tokens": 6, "temperature": 0})
    assert result is not None and again == expected


def spied_chat(monkeypatch, capsys, path, lines, *options):
    """Run `quanta chat` on ``lines``; returns (status, captured, [(roles, prompt tokens) of each turn sent])."""
    sent = []
    real = chat.answer

    def spy(llm, messages, kwargs):
        sent.append(([m["role"] for m in messages], [m["content"] for m in messages],
                     len(llm.chat_prompt(messages)), llm.n_ctx))
        return real(llm, messages, kwargs)

    monkeypatch.setattr(chat, "answer", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = main(["chat", "-m", str(path), "--temperature", "0", *options])
    return rc, capsys.readouterr(), sent


def test_a_full_context_drops_the_oldest_turns_and_keeps_the_session(smollm2_path, monkeypatch, capsys):
    topics = ["the sea", "mountains", "rivers", "deserts", "forests", "the sky", "cities"]
    lines = [f"Write two sentences about {t}, with as many details as you can think of." for t in topics]
    rc, out, sent = spied_chat(monkeypatch, capsys, smollm2_path, lines, "--n-ctx", "256", "--max-tokens", "40",
                               "--system", "You are a poet.")
    assert rc == 0 and len(sent) == len(lines)  # every turn was answered: the session survived
    for roles, contents, n_prompt, n_ctx in sent:
        assert roles[0] == "system" and contents[0] == "You are a poet." and roles[1] == "user"
        assert contents[-1] in lines and n_prompt + min(40, n_ctx // 4) <= n_ctx == 256
    assert lines[0] not in sent[-1][1]  # the first exchange was dropped ...
    assert "dropped the" in out.err and "kept the system prompt" in out.err  # ... and stderr said so
    assert len(sent[-1][0]) >= 3  # the newest exchanges are kept


def test_a_message_longer_than_the_context_is_not_sent(smollm2_path, monkeypatch, capsys):
    rc, out, sent = spied_chat(monkeypatch, capsys, smollm2_path, ["word " * 400, "Hi!"], "--n-ctx", "256",
                               "--max-tokens", "4")
    assert rc == 0 and "does not fit in the context of 256 tokens" in out.err
    assert [contents for _, contents, _, _ in sent] == [["Hi!"]]
