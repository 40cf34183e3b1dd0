"""/v1/chat/completions and /v1/completions: validate and plan the request (tokenizing off the event loop),
admit it, hand it to the engine loop, then stream its events as Server-Sent Events or collect them into one body.

Nothing is sent before the engine has taken the request, so every refusal is a plain error response. A client
that leaves — while its prompt is prefilled, mid-stream, or while a whole response is computed — is seen by a
watcher on the ASGI receive channel, and its request is aborted before the engine's next step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from quanta.engine import TokenLogprob
from quanta.server.engine_loop import Accepted, ChoiceOutput, EngineLoop, Failed, Job, Rejected
from quanta.server.errors import APIError, internal, invalid, unavailable
from quanta.server.protocol import ChatBody, CompletionBody, Plan, chat_plan, completion_plan, parse_body, parse_json
from quanta.server.responses import DONE, Usage, Writer, error_event
from quanta.server.structured import ToolStream
from quanta.server.state import LOADING_RETRY_S, ServerState

DISCONNECTED = object()  # put into a job's events by its watcher when the client goes away
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the response


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body; 413 past ``limit`` bytes (from Content-Length, or counted as it arrives)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "the client closed the connection before sending its whole request",
                       code="client_closed") from None
    return parse_json(b"".join(chunks))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size:,} bytes or more; the limit is {limit:,}",
                    code="request_too_large")


async def chat_completions(request: Request) -> Any:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Any:
    return await _generate(request, chat=False)


async def _generate(request: Request, chat: bool) -> Any:
    state: ServerState = request.app.state.quanta
    model = state.ready()
    body = parse_body(ChatBody if chat else CompletionBody, await read_json(request, state.config.max_body_bytes))
    plan: Plan = await run_in_threadpool(chat_plan if chat else completion_plan, body, model.tokenizer, model.n_ctx,
                                         model.n_vocab)
    engine_loop = state.admit(len(plan.choices))
    job = Job(plan.choices, asyncio.get_running_loop())
    try:
        engine_loop.submit(job)
        first = await job.events.get()
        if isinstance(first, Rejected):
            raise (invalid(first.message) if first.user else internal())
        if isinstance(first, Failed):
            raise unavailable(first.message, first.code, LOADING_RETRY_S)
        assert isinstance(first, Accepted)
        writer = Writer(chat, state.model_name, model.tokenizer, plan.include_usage)
        if plan.stream:
            return EventStream(job, plan, writer, engine_loop)
        return await _collect(request.receive, job, plan, writer, engine_loop)
    except BaseException:
        engine_loop.abort(job)  # harmless when it already ended
        raise


async def _watch(receive: Receive, job: Job) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    job.events.put_nowait(DISCONNECTED)


class _Results:
    """Each choice's text, logprobs and finish reason, gathered from a job's events, and the request's usage."""

    def __init__(self, plan: Plan):
        self.plan = plan
        k = len(plan.choices)
        self.texts: list[list[str]] = [[] for _ in range(k)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(k)]
        self.reasons: list[str | None] = [None] * k
        self.usage = Usage(prompt_tokens=plan.prompt_tokens)
        self.open = k

    def take(self, event: ChoiceOutput) -> str | None:
        """Record one output; returns the problem when it ended its choice abnormally (error, abort)."""
        i, out = event.index, event.output
        self.texts[i].append(out.text)
        self.logprobs[i] += out.logprobs
        if not out.finished:
            return None
        self.open -= 1
        self.reasons[i] = out.finish_reason
        self.usage.add(out.stats, self.plan.choices[i].leader is None)
        if out.finish_reason in ("stop", "length"):
            return None
        return out.error or "the request was ended by the server"

    def echo(self, i: int) -> str:
        n = len(self.plan.choices) // max(len(self.plan.echo), 1)
        return self.plan.echo[i // n] if self.plan.echo else ""


async def _collect(receive: Receive, job: Job, plan: Plan, writer: Writer, engine_loop: EngineLoop) -> Response:
    watcher = asyncio.create_task(_watch(receive, job))
    results = _Results(plan)
    try:
        while results.open:
            event = await job.events.get()
            if event is DISCONNECTED:
                engine_loop.abort(job)
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(event, Failed):
                raise (internal(event.message) if event.code == "internal_error"
                       else unavailable(event.message, event.code, LOADING_RETRY_S))
            problem = results.take(event)
            if problem is not None:
                raise internal(problem)
    finally:
        watcher.cancel()
    lp = plan.logprobs is not None
    choices = []
    for i in range(len(plan.choices)):
        text: str | None = results.echo(i) + "".join(results.texts[i])
        reason, calls = results.reasons[i] or "stop", None
        if plan.tools is not None:
            text, calls = plan.tools.parse(text)
            reason = "tool_calls" if calls else reason
            text = text if text is not None or calls else ""
        choices.append(writer.choice(i, text, reason, results.logprobs[i] if lp else None, calls))
    return JSONResponse(writer.response(choices, results.usage))


class EventStream:
    """An ASGI response streaming a job's events as OpenAI's chunks; whatever ends it (the client leaving, a
    send failing, cancellation) aborts what is still running."""

    def __init__(self, job: Job, plan: Plan, writer: Writer, engine_loop: EngineLoop):
        self.job, self.plan, self.writer, self.engine_loop = job, plan, writer, engine_loop
        self.ended = False  # every choice finished, or the server ended them
        self.tools = [ToolStream(plan.tools) for _ in plan.choices] if plan.tools is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(_watch(receive, self.job))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for chunk in self._chunks():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            if not self.ended:
                self.engine_loop.abort(self.job)

    async def _chunks(self) -> Any:
        """The stream's bytes: each batch of events that arrived together becomes one write."""
        w, plan = self.writer, self.plan
        results = _Results(plan)
        offsets = [len(results.echo(i)) for i in range(len(plan.choices))]
        opening = [w.role_chunk(i) for i in range(len(plan.choices))] if w.chat else [
            w.delta_chunk(i, results.echo(i), [] if plan.logprobs is not None else None)
            for i in range(len(plan.choices)) if plan.echo]
        yield b"".join(opening)
        queue = self.job.events
        while results.open:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            out: list[bytes] = []
            for event in events:
                if event is DISCONNECTED:
                    return
                if self._render(event, results, offsets, out):
                    yield b"".join(out)
                    return
            yield b"".join(out)
        self.ended = True
        if plan.include_usage:
            yield w.usage_chunk(results.usage) + DONE
        else:
            yield DONE

    def _render(self, event: Any, results: _Results, offsets: list[int], out: list[bytes]) -> bool:
        """Append ``event``'s chunks to ``out``; True when it ended the stream (an error event and [DONE])."""
        w = self.writer
        if isinstance(event, Failed):
            self.ended = True
            out += [error_event(event.message, event.code), DONE]
            return True
        o, i = event.output, event.index
        problem = results.take(event)
        lp = self.plan.logprobs is not None
        text, calls = o.text, []
        if self.tools is not None:  # content goes out until a call starts; the calls when the choice ends
            text = self.tools[i].push(o.text)
            if o.finished and problem is None:
                rest, calls = self.tools[i].finish()
                text += rest
        if text or (lp and o.logprobs):
            out.append(w.delta_chunk(i, text, o.logprobs if lp else None, offsets[i]))
            offsets[i] += len(text)
        if problem is not None:
            out += [error_event(problem, "internal_error" if o.finish_reason == "error" else "shutdown"), DONE]
            return True
        if calls:
            out.append(w.tool_call_chunks(i, calls))
        if o.finished:
            out.append(w.finish_chunk(i, "tool_calls" if calls else o.finish_reason))
        return False
