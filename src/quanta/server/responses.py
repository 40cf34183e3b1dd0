"""OpenAI's response bodies and stream chunks, written as OpenAI writes them, and the Server-Sent Events framing.

A chat stream: one chunk per choice with ``{"role": "assistant", "content": ""}``, content deltas, a chunk with an
empty delta and the ``finish_reason`` per choice, with ``include_usage`` a chunk with ``choices: []`` and the
usage (every other chunk then has ``"usage": null``), then ``data: [DONE]``. A text-completion stream is the same
without the role chunks, ``text`` in place of ``delta``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quanta import __version__
from quanta.engine import GenerationStats, TokenLogprob

DONE = b"data: [DONE]\n\n"
FINGERPRINT = f"fp_quanta_{__version__}"
MIN_LOGPROB = -9999.0  # what OpenAI reports for tokens the model rules out (JSON has no -inf)


def sse(data: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Usage:
    """Token counts of a request: the prompt once per prompt, the completions of every choice."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, stats: GenerationStats | None, leader: bool) -> None:
        if stats is None:
            return
        self.completion_tokens += stats.completion_tokens
        if leader:
            self.cached_tokens += stats.cached_tokens

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Writer:
    """The bodies of one request (its id, creation time and model name), chat or text completion."""

    def __init__(self, chat: bool, model: str, tokenizer: Any, include_usage: bool = False):
        self.chat, self.model, self.tokenizer, self.include_usage = chat, model, tokenizer, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        # a content chunk is this request's constant head and tail around one JSON string: encoded once
        head, tail = self._chunk([{"index": 0, "delta" if chat else "text": "\0"}]).split(b'"\\u0000"')
        self._head, self._tail = head.split(b'{"index":0')[0], tail[1:]  # tail: without the template's "}"

    # ---- stream chunks -------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def role_chunk(self, index: int) -> bytes:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_chunk(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                    offset: int = 0) -> bytes:
        if logprobs is None:  # the common case, once per token: no dicts, one small json.dumps
            content = json.dumps(text, ensure_ascii=False).encode()
            delta = b'{"content":' + content + b"}" if self.chat else content
            return b"".join((self._head, b'{"index":%d,' % index, b'"delta":' if self.chat else b'"text":', delta,
                             b',"logprobs":null,"finish_reason":null}', self._tail))
        lp = self.logprobs(logprobs, offset)
        if self.chat:
            return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])
        return self._chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None}])

    def finish_chunk(self, index: int, reason: str) -> bytes:
        if self.chat:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])

    def tool_call_chunks(self, index: int, calls: list[dict[str, Any]]) -> bytes:
        """A choice's calls as OpenAI streams them: per call a delta with its id, type and name, then its
        arguments."""
        out = []
        for k, call in enumerate(calls):
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            for part in (head, args):
                out.append(self._chunk([{"index": index, "delta": {"tool_calls": [part]}, "logprobs": None,
                                         "finish_reason": None}]))
        return b"".join(out)

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "system_fingerprint": FINGERPRINT,
                    "choices": [], "usage": usage.body()})

    # ---- whole responses -----------------------------------------------------------------------------------
    def choice(self, index: int, text: str | None, reason: str, logprobs: Sequence[TokenLogprob] | None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        lp = None if logprobs is None else self.logprobs(logprobs, 0)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    def response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": FINGERPRINT,
                "choices": choices, "usage": usage.body()}

    # ---- logprobs ------------------------------------------------------------------------------------------
    def logprobs(self, items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        """Chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or the completions' parallel lists
        (``text_offset`` counted in characters from ``offset``)."""
        if self.chat:
            return {"content": [self._entry(t.token_id, t.logprob) | {
                "top_logprobs": [self._entry(i, lp) for i, lp in t.top]} for t in items], "refusal": None}
        tokens = [self._text(t.token_id) for t in items]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(t.logprob) for t in items],
                "top_logprobs": [{self._text(i): _finite(lp) for i, lp in t.top} for t in items],
                "text_offset": offsets}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        piece = self.tokenizer.token_to_piece(token_id, special=True)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(piece)}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_to_piece(token_id, special=True).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def error_event(message: str, code: str) -> bytes:
    """The event that ends a stream which cannot finish (the server shuts down, the model failed)."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
