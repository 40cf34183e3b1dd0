"""`quanta chat [-m MODEL]`: an interactive multi-turn conversation through the model's chat template.

Commands: ``/reset`` forgets the conversation, ``/exit`` (or end of input) quits. Ctrl-C stops the answer
being written, not the program. Each turn re-sends the whole history; the KV cache reuses its common prefix.
When the history outgrows the context, the oldest exchanges are dropped (the system prompt is kept) so that the
prompt leaves room for a reply, and stderr says so; a message that cannot fit even alone is not sent. Only
``quanta.LLM``'s public API is used here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from quanta.cli.run import add_model_options, add_sampling_options, load_llm, print_stats, sampling_kwargs
from quanta.errors import ContextOverflowError

HELP = "type a message; /reset forgets the conversation, /exit quits (Ctrl-C stops an answer)"


def add_parser(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_sampling_options(p)


def read_line(prompt: str) -> str | None:
    """The next input line; None at end of input. Ctrl-C at the prompt just starts a new line."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            print(file=sys.stderr)


def answer(llm: Any, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Stream the assistant's reply; returns (text so far, result or None when interrupted)."""
    pieces: list[str] = []
    stream = llm.stream_chat(messages, **kwargs)
    try:
        for piece in stream:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        sys.stdout.write(" [interrupted]")
        return "".join(pieces), None
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return "".join(pieces), llm.last_result


def _prompt_tokens(llm: Any, messages: list[dict[str, str]]) -> int | None:
    """The prompt length of ``messages``, None when it cannot fit the context at all."""
    try:
        return len(llm.chat_prompt(messages))
    except ContextOverflowError:
        return None


def fit_history(llm: Any, system: list[dict[str, str]], history: list[dict[str, str]],
                reply_room: int) -> int | None:
    """How many of the oldest ``history`` messages to drop (whole exchanges, so it still starts with the user)
    for the prompt to leave ``reply_room`` tokens of the context; None when the last message alone does not
    fit (``history`` ends with the new user message)."""
    dropped = 0
    while True:
        n = _prompt_tokens(llm, system + history[dropped:])
        if n is not None and n + reply_room <= llm.n_ctx:
            return dropped
        if dropped + 1 >= len(history):  # only the new message is left: send it if it fits at all
            return dropped if n is not None and n < llm.n_ctx else None
        dropped += 2


def run(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    kwargs = sampling_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    reply_room = min(args.max_tokens, llm.n_ctx // 4)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"{llm.path.name} — {HELP}", file=sys.stderr)
    while True:
        line = read_line("> " if interactive else "")
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history.clear()
            print("(conversation reset)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        dropped = fit_history(llm, system, history, reply_room)
        if dropped is None:
            history.pop()
            print(f"(that message does not fit in the context of {llm.n_ctx} tokens; it was not sent — "
                  "send a shorter one, or raise --n-ctx)", file=sys.stderr)
            continue
        if dropped:
            del history[:dropped]
            print(f"(the context of {llm.n_ctx} tokens is full: dropped the {dropped} oldest messages"
                  f"{', kept the system prompt' if system else ''})", file=sys.stderr)
        text, result = answer(llm, system + history, kwargs)
        history.append({"role": "assistant", "content": text})
        if args.stats and result is not None:
            print_stats(result.stats)
