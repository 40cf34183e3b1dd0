"""Load, disconnect and soak runs against `quanta serve`: every response checked, figures reported.

    python scripts/serve_load.py --spawn -- --n-ctx 1024                  # start a server (extra args after --)
    python scripts/serve_load.py --url http://127.0.0.1:8080 --pid PID   # or use a running one (PID: for RSS)

Modes (each run does the load, then optionally the others):
- load: ``--requests`` requests at ``--concurrency``, chat and completions, streamed and not, short and long
  prompts, max_tokens drawn from ``--max-tokens LO,HI``; ``--processes N`` spreads the clients over N processes
  that start together (one Python client cannot read tens of thousands of stream events a second). Every response is checked: non-streamed bodies have
  OpenAI's shape and consistent usage; every stream is well-formed (one id, the role chunk first for chat, content
  deltas, one finish chunk per choice, the usage chunk with ``choices: []``, ``[DONE]`` last). Reported: lost
  requests (no response), 5xx, malformed, p50/p95 TTFT (streams: request sent → first content), aggregate
  tok/s (completion tokens / wall time), the server's peak RSS.
- ``--disconnects N``: N clients that leave at random points (after headers = during prefill, mid-stream, or a
  non-streamed request whose client gives up); then /metrics must show no KV block held and no live sequence,
  a normal request must still succeed, and RSS before/after is reported.
- ``--soak SECONDS``: steady load at ``--concurrency`` for that long; RSS and KV usage sampled every 10 s.

Only loopback addresses are accepted: this is a test of a local server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

TOPICS = ["the sea", "a lighthouse", "prime numbers", "bread", "the moon", "trains", "bees", "winter", "chess",
          "volcanoes", "libraries", "rivers"]
PARAGRAPH = ("The history of the subject is long and full of small discoveries, each of which changed how people "
             "thought about it. ")


@dataclass
class Outcome:
    ok: bool
    status: int | None = None
    problem: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    tokens: int = 0
    stream: bool = False
    token_times: list[float] = field(default_factory=list)  # when each content chunk of a stream arrived


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        o = self.outcomes
        ttft = sorted(x.ttft_s for x in o if x.ttft_s is not None)
        lat = sorted(x.latency_s for x in o if x.ok)
        tokens = sum(x.tokens for x in o if x.ok)
        problems: dict[str, int] = {}
        for x in o:
            if not x.ok:
                problems[x.problem or "?"] = problems.get(x.problem or "?", 0) + 1
        times = [x.token_times for x in o if x.ok and x.token_times]
        decode = None
        if times and len(times) == len(o):  # bench's definition: tokens after every stream's first, over that time
            t0, t1 = max(t[0] for t in times), max(t[-1] for t in times)
            after = sum(sum(1 for u in t if u > t0) for t in times)
            decode = round(after / (t1 - t0), 1) if t1 > t0 else None
        return {"requests": len(o), "ok": sum(x.ok for x in o), "lost": sum(x.status is None for x in o),
                "5xx": sum(x.status is not None and x.status >= 500 for x in o),
                "malformed": sum(x.status == 200 and not x.ok for x in o),
                "streams": sum(x.stream for x in o), "completion_tokens": tokens, "wall_s": round(self.wall_s, 1),
                "aggregate_tok_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
                "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95), "latency_p50_s": _pct(lat, 50),
                "latency_p95_s": _pct(lat, 95), "decode_tok_s_after_all_first": decode, "problems": problems}


def _pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * p / 100))], 3)


# ---- one request -------------------------------------------------------------------------------------------
def fixed_request(rng: random.Random, prompt_tokens: int, new_tokens: int, vocab: int,
                  model: str) -> tuple[str, dict[str, Any]]:
    """A streamed completion of random token ids, greedy past end-of-generation (`quanta bench`'s requests)."""
    lo, hi = min(1000, vocab // 4), vocab - vocab // 8
    return "/v1/completions", {"model": model, "prompt": [rng.randrange(lo, hi) for _ in range(prompt_tokens)],
                               "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}


def make_request(rng: random.Random, lo: int, hi: int, model: str) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(TOPICS)
    long = rng.random() < 0.3
    text = (PARAGRAPH * rng.randint(2, 8) if long else "") + f"Tell me something about {topic}."
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0, 0.7, 1.0]),
                            "seed": rng.randrange(1000), "stream": rng.random() < 0.5}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.7:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    start = time.perf_counter()
    try:
        if body["stream"]:
            return await _stream(client, path, body, start)
        r = await client.post(path, json=body)
        out = Outcome(False, r.status_code, latency_s=time.perf_counter() - start)
        if r.status_code != 200:
            out.problem = f"status {r.status_code}"
            return out
        return _check_body(r.json(), path, body, out)
    except httpx.HTTPError as e:
        return Outcome(False, None, f"{type(e).__name__}", latency_s=time.perf_counter() - start,
                       stream=body["stream"])


def _check_body(data: dict[str, Any], path: str, body: dict[str, Any], out: Outcome) -> Outcome:
    chat = path.endswith("chat/completions")
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    usage = data["usage"]
    if not isinstance(text, str) or choice["finish_reason"] not in ("stop", "length"):
        out.problem = "bad choice"
    elif usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        out.problem = "usage does not add up"
    elif usage["completion_tokens"] > body["max_tokens"] or (
            choice["finish_reason"] == "length" and usage["completion_tokens"] != body["max_tokens"]):
        out.problem = "completion tokens vs max_tokens"
    else:
        out.ok, out.tokens = True, usage["completion_tokens"]
    return out


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], start: float) -> Outcome:
    chat = path.endswith("chat/completions")
    out = Outcome(False, None, stream=True)
    events = []
    async with client.stream("POST", path, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.problem = f"status {r.status_code}"
            return out
        buffer = ""
        async for text in r.aiter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                if _has_content(event, chat):
                    now = time.perf_counter()
                    out.ttft_s = now - start if out.ttft_s is None else out.ttft_s
                    out.token_times.append(now)
                events.append(event)
    out.latency_s = time.perf_counter() - start
    out.problem = _stream_problem(events, buffer, chat, body["max_tokens"])
    if out.problem is None:
        out.ok = True
        out.tokens = json.loads(events[-2][6:])["usage"]["completion_tokens"]
    return out


def _has_content(event: str, chat: bool) -> bool:
    if not event.startswith("data: {"):
        return False
    choices = json.loads(event[6:]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content") if chat else choices[0].get("text"))


def _stream_problem(events: list[str], rest: str, chat: bool, max_tokens: int) -> str | None:
    """Why a stream is not OpenAI's sequence, or None."""
    if rest or not events or any(not e.startswith("data: ") for e in events):
        return "bad framing"
    if events[-1] != "data: [DONE]":
        return "no [DONE] at the end"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "error event"
    if len({c["id"] for c in chunks}) != 1:
        return "several ids"
    *body, usage = chunks
    if usage["choices"] != [] or "completion_tokens" not in (usage.get("usage") or {}):
        return "no usage chunk"
    if chat and (not body or body[0]["choices"][0]["delta"] != {"role": "assistant", "content": ""}):
        return "no role chunk first"
    finishes = [c for c in body if c["choices"][0]["finish_reason"] is not None]
    if len(finishes) != 1 or finishes[0] is not body[-1] or finishes[0]["choices"][0]["finish_reason"] not in (
            "stop", "length"):
        return "finish chunk"
    if any(c.get("usage", None) is not None for c in body):
        return "usage on a content chunk"
    n = usage["usage"]["completion_tokens"]
    if n > max_tokens or (finishes[0]["choices"][0]["finish_reason"] == "length" and n != max_tokens):
        return "completion tokens vs max_tokens"
    return None


# ---- runs --------------------------------------------------------------------------------------------------
async def load(url: str, n: int, concurrency: int, lo: int, hi: int, seed: int, model: str,
               until: float | None = None, fixed: tuple[int, int, int] | None = None) -> Report:
    rng = random.Random(seed)
    report = Report()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900), limits=limits) as client:
        counter = iter(range(n))

        async def worker() -> None:
            for _ in counter:
                if until is not None and time.monotonic() > until:
                    return
                request = fixed_request(rng, *fixed, model) if fixed else make_request(rng, lo, hi, model)
                report.outcomes.append(await send(client, *request))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.wall_s = time.perf_counter() - start
    return report


def load_in_processes(processes: int, url: str, n: int, concurrency: int, lo: int, hi: int, seed: int, model: str,
                      fixed: tuple[int, int, int] | None = None) -> Report:
    """:func:`load` split over ``processes`` client processes, all starting at the same moment; one report."""
    if processes == 1:
        return asyncio.run(load(url, n, concurrency, lo, hi, seed, model, fixed=fixed))
    start = time.perf_counter() + 1.0  # CLOCK_MONOTONIC: the same clock in every process
    shares = [(n * (i + 1) // processes - n * i // processes,
               concurrency * (i + 1) // processes - concurrency * i // processes) for i in range(processes)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        reports = pool.starmap(_load_share, [(start, url, k, c, lo, hi, seed + i, model, fixed)
                                             for i, (k, c) in enumerate(shares)])
    return Report([o for r in reports for o in r.outcomes], max(r.wall_s for r in reports))


def _load_share(start: float, url: str, n: int, concurrency: int, lo: int, hi: int, seed: int, model: str,
                fixed: tuple[int, int, int] | None) -> Report:
    time.sleep(max(0.0, start - time.perf_counter()))
    return asyncio.run(load(url, n, concurrency, lo, hi, seed, model, fixed=fixed))


async def disconnects(url: str, n: int, concurrency: int, seed: int, model: str) -> dict[str, int]:
    rng = random.Random(seed)
    kinds: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)

    async def leave(i: int) -> None:
        kind = rng.choice(["prefill", "stream", "whole"])
        kinds[kind] = kinds.get(kind, 0) + 1
        prompt = PARAGRAPH * rng.randint(1, 10) + "Tell me a long story."
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 300,
                "ignore_eos": True, "stream": kind != "whole", "seed": i}
        async with sem, httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600)) as client:
            try:
                if kind == "whole":
                    await asyncio.wait_for(client.post("/v1/chat/completions", json=body), rng.uniform(0.1, 4.0))
                    return
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if kind == "stream":
                        k = rng.randint(1, 30)
                        async for _ in r.aiter_text():
                            k -= 1
                            if k <= 0:
                                break
            except (asyncio.TimeoutError, httpx.HTTPError):
                pass

    await asyncio.gather(*(leave(i) for i in range(n)))
    return kinds


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["quanta_live_sequences"] == 0 and m["quanta_kv_blocks_used"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def rss_kib(pid: int | None) -> dict[str, int]:
    """VmRSS and VmHWM of the server: its process and its children (the engine's process) summed."""
    if pid is None:
        return {}
    fields = {"VmRSS": 0, "VmHWM": 0}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in fields:
                fields[key] += int(value.split()[0])
    return fields


# ---- the server ----------------------------------------------------------------------------------------------
def spawn(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "quanta", "serve", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        print(line.rstrip(), file=sys.stderr)
        if " ready at " in line:
            return proc, line.split(" ready at ")[1].strip()
    raise SystemExit(f"the server exited with status {proc.wait()} before it was ready")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if not (host in ("localhost", "::1") or host.startswith("127.")):
        raise SystemExit(f"serve_load only targets a local server (loopback), not {host!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (loopback only)")
    p.add_argument("--pid", type=int, help="the running server's process id (for RSS)")
    p.add_argument("--spawn", action="store_true", help="start `quanta serve` (arguments after --)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--processes", type=int, default=1, help="client processes the load is spread over")
    p.add_argument("--max-tokens", default="4,32", help="LO,HI: each request's max_tokens is drawn from it")
    p.add_argument("--fixed", metavar="P,N,VOCAB", default=None,
                   help="instead of the mix: streamed completions of P random token ids (below VOCAB), N new tokens "
                        "each, greedy past end-of-generation (as `quanta bench --concurrency`)")
    p.add_argument("--disconnects", type=int, default=0, help="then N clients that leave at random points")
    p.add_argument("--soak", type=float, default=0, help="then steady load for this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    proc = None
    if args.spawn:
        proc, url = spawn(extra)
        pid = proc.pid
    elif args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        p.error("give --url or --spawn")
    check_loopback(url)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    figures: dict[str, Any] = {"rss_start_kib": rss_kib(pid)}
    try:
        if args.requests:
            fixed = tuple(int(x) for x in args.fixed.split(",")) if args.fixed else None
            report = load_in_processes(args.processes, url, args.requests, args.concurrency, lo, hi, args.seed, model,
                                       fixed)
            figures["load"] = report.summary()
            figures["load"]["metrics_after"] = _idle_figures(wait_idle(url))
            figures["rss_after_load_kib"] = rss_kib(pid)
            print(json.dumps(figures["load"], indent=1), file=sys.stderr)
        if args.disconnects:
            before = rss_kib(pid)
            kinds = asyncio.run(disconnects(url, args.disconnects, args.concurrency, args.seed + 1, model))
            after_metrics = wait_idle(url)
            ok = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
            figures["disconnects"] = {"clients": args.disconnects, "kinds": kinds, "rss_before_kib": before,
                                      "rss_after_kib": rss_kib(pid), "serving_after": ok.status_code == 200,
                                      **_idle_figures(after_metrics)}
            print(json.dumps(figures["disconnects"], indent=1), file=sys.stderr)
        if args.soak:
            figures["soak"] = asyncio.run(_soak(url, args, lo, hi, model, pid))
            print(json.dumps(figures["soak"], indent=1), file=sys.stderr)
    finally:
        figures["rss_peak_kib"] = rss_kib(pid).get("VmHWM")  # the kernel keeps the peak
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            figures["server_exit_status"] = proc.wait(120)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    load_ok = "load" not in figures or (figures["load"]["ok"] == figures["load"]["requests"])
    return 0 if load_ok else 1


def _idle_figures(m: dict[str, float]) -> dict[str, Any]:
    """What /metrics says once the server is idle: blocks and sequences held, and the counts so far."""
    return {"kv_blocks_used": m["quanta_kv_blocks_used"], "live_sequences": m["quanta_live_sequences"],
            "finished": {k.split('"')[1]: v for k, v in m.items() if k.startswith("quanta_sequences_finished_total")},
            "responses": {k.split('status="')[1].split('"')[0]: v for k, v in m.items()
                          if k.startswith("quanta_requests_total") and "chat/completions" in k},
            "5xx": sum(v for k, v in m.items() if k.startswith("quanta_requests_total") and 'status="5' in k)}


async def _soak(url: str, args: argparse.Namespace, lo: int, hi: int, model: str, pid: int | None) -> dict:
    samples = []
    until = time.monotonic() + args.soak

    async def sample() -> None:
        while time.monotonic() < until:
            m = await asyncio.to_thread(scrape, url)
            samples.append({"t_s": round(args.soak - (until - time.monotonic())), "rss_kib": rss_kib(pid).get("VmRSS"),
                            "kv_blocks_used": m["quanta_kv_blocks_used"], "live": m["quanta_live_sequences"]})
            await asyncio.sleep(10)

    task = asyncio.create_task(sample())
    report = await load(url, 10**9, args.concurrency, lo, hi, args.seed + 2, model, until=until)
    task.cancel()
    return {"seconds": args.soak, **report.summary(), "samples": samples}


if __name__ == "__main__":
    sys.exit(main())
