"""`quanta bench --concurrency`: the burst's figures from a scripted engine and clock (the definitions, by hand),
and the verb end to end on the real SmolLM2 on the CPU (every request's tokens, the prefix cache's hit)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from quanta.bench import serving
from quanta.cli.main import main


class ScriptedEngine:
    """Two requests: A gets tokens in steps 1-4, B (queued behind A's prefill) in steps 2-5; one step per second."""

    def __init__(self):
        self.script = [[(0, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(1, 1)]]
        self.added: list[list[int]] = []
        self.params: list = []

    def reset_prefix_cache(self) -> None:
        pass

    def add_request(self, prompt, params, stop, constraint=None) -> int:
        assert stop.ignore_eos and stop.max_tokens == 4 and constraint is None
        self.added.append(prompt)
        self.params.append(params)
        return len(self.added) - 1

    def has_unfinished(self) -> bool:
        return bool(self.script)

    def step(self) -> list:
        return [SimpleNamespace(request_id=r, new_token_ids=[7] * n) for r, n in self.script.pop(0)]

    def release(self, request_id: int) -> None:
        pass


def test_burst_figures_follow_their_definitions(monkeypatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(serving.time, "perf_counter", lambda: float(next(clock)))
    r = serving.run_burst(ScriptedEngine(), [[1] * 10, [2] * 10], 4)
    # t0 = 0; steps end at 1..5; the last first token at t = 2; the end at t = 6 (one more clock read)
    assert r["prefill_tok_s"] == 20 / 2
    assert r["decode_tok_s"] == 5 / (6 - 2)  # tokens of steps 3-5 (A: 2, B: 3) over the time after t = 2
    assert r["per_seq_decode_tok_s"] == 3 / 3  # both: 3 tokens after the first in 3 s
    assert r["ttft_s"] == [1.0, 2.0] and r["steps"] == 5


def test_bursts_are_greedy_or_sampled_with_request_i_seeded_i() -> None:
    greedy, sampled = ScriptedEngine(), ScriptedEngine()
    serving.run_burst(greedy, [[1] * 10, [2] * 10], 4)
    serving.run_burst(sampled, [[1] * 10, [2] * 10], 4, temperature=0.7)
    assert [p.temperature for p in greedy.params] == [0, 0]
    assert [(p.temperature, p.seed, p.top_k, p.top_p) for p in sampled.params] == [(0.7, 0, 40, 0.95),
                                                                                  (0.7, 1, 40, 0.95)]


def test_burst_refuses_a_short_request(monkeypatch) -> None:
    engine = ScriptedEngine()
    engine.script[-1] = []  # B never gets its 4th token
    with pytest.raises(AssertionError):
        serving.run_burst(engine, [[1] * 10, [2] * 10], 4)


def test_concurrency_bench_on_the_cpu(smollm2_path, tmp_path) -> None:
    out = tmp_path / "serving.json"
    status = main(["bench", "-m", str(smollm2_path), "--device", "cpu", "--threads", "2", "--concurrency", "1,3",
                   "-p", "16", "-n", "4", "--repeats", "1", "--prefix-tokens", "40", "--json", str(out),
                   "--plot", str(tmp_path / "serving.png"), "--vs", "llama.cpp"])
    assert status == 0 and (tmp_path / "serving.png").stat().st_size > 0
    r = json.loads(out.read_text())
    assert [row["concurrency"] for row in r["runs"]] == [1, 3]
    for row in r["runs"]:
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["per_seq_decode_tok_s"] > 0
        assert row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_p99"]
        assert row["decode_tok_s_spread"]["min"] == row["decode_tok_s"] == row["decode_tok_s_spread"]["max"]
    assert r["prefix_cache"]["cached_tokens"] == [0, 32]  # the shared prefix's full blocks of 16
    assert r["peer"]["name"] == "llama.cpp" and [row["concurrency"] for row in r["peer"]["runs"]] == [1, 3]
    assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in r["peer"]["runs"])


def test_constrained_bench_runs_each_burst_free_then_constrained(smollm2_path, tmp_path, capsys) -> None:
    out = tmp_path / "constrained.json"
    status = main(["bench", "-m", str(smollm2_path), "--device", "cpu", "--threads", "2", "--concurrency", "2",
                   "-p", "8", "-n", "16", "--repeats", "1", "--prefix-tokens", "0", "--regex", "(a|b| ){8}",
                   "--json", str(out)])
    assert status == 0 and "under the regex constraint" in capsys.readouterr().out
    row = json.loads(out.read_text())["runs"][0]
    assert 1 < row["tokens_per_seq"] <= 8  # the grammar ends every request after 8 characters; free ones run 16
    assert row["free_decode_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["free_per_seq_decode_tok_s"] > 0


@pytest.mark.parametrize("args,message", [
    (["--regex", "a+"], "add --concurrency"),
    (["--regex", "a+", "--concurrency", "2", "--vs", "llama.cpp"], "measure a constraint or a temperature without"),
    (["--temperature", "0.8"], "add --concurrency"),
    (["--temperature", "0.8", "--concurrency", "2", "--vs", "llama.cpp"], "runs its bursts free and greedy"),
    (["--temperature", "-1", "--concurrency", "2"], "--temperature takes a number from 0"),
])
def test_a_constraint_needs_the_batched_bench_without_a_peer(args, message, capsys) -> None:
    assert main(["bench", "--device", "cpu", *args]) != 0
    assert message in capsys.readouterr().err


def test_bad_concurrency_is_a_clear_error(capsys) -> None:
    assert main(["bench", "--concurrency", "4,x"]) != 0
    assert "--concurrency takes comma-separated counts" in capsys.readouterr().err


def test_llama_cpp_peer_decodes_each_sequence_of_a_batch_as_if_alone(smollm2_path) -> None:
    """The peer's driver (one context, a sequence id per request, one decode call per step): a burst of three
    prompts of different lengths gives each the greedy tokens llama.cpp gives it alone."""
    from quanta.bench.llama_batched import LlamaCppBatched

    prompts = [list(range(1000, 1000 + n)) for n in (5, 9, 14)]
    prompts[1][3] = 4242  # different texts, not only lengths
    peer = LlamaCppBatched(smollm2_path, threads=2, n_ctx_per_seq=32, max_seqs=3, n_batch=8)  # prefill in chunks
    try:
        together = peer.run_burst(prompts, 6)
        alone = [peer.run_burst([p], 6)["tokens"][0] for p in prompts]
    finally:
        peer.close()
    assert together["tokens"] == alone
    assert len(set(map(tuple, alone))) == 3 and all(len(t) == 6 for t in alone)
    assert together["steps"] == 6 and together["decode_tok_s"] > 0
