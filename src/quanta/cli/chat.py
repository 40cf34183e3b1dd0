"""`quanta chat [-m MODEL]`: an interactive multi-turn conversation through the model's chat template.

Commands: ``/reset`` forgets the conversation, ``/exit`` (or end of input) quits. Ctrl-C stops the answer
being written, not the program. Each turn re-sends the whole history; the KV cache reuses its common prefix.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from quanta.cli.run import add_model_options, add_sampling_options, load_llm, print_stats, sampling_kwargs

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


def run(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    kwargs = sampling_kwargs(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
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
        text, result = answer(llm, system + history, kwargs)
        history.append({"role": "assistant", "content": text})
        if args.stats and result is not None:
            print_stats(result.stats)
