"""bench/e2e.py's queued mode (`--queued N`, docs/lookup.md "What is left"): its
arguments, the engine sets it starts (max_num_seqs = c, one set per concurrency), and the
bookkeeping of `Engine.measure` (N requests in one `generate` call), with a stand-in for
vLLM's `LLM`: no engine is started."""

from __future__ import annotations

import types

import pytest

from bench import e2e
from bench.lib import engines
from bench.lib.engines import Engine, submission


def test_queued_arguments():
    args = e2e.parse_args(["--queued", "24", "--concurrency", "8", "--interleave", "2"])
    assert (args.queued, args.prompts, args.concurrency, args.interleave) == (24, 24, "8", 2)
    # An explicit --prompts stays (the queue cycles them); without --queued nothing moves.
    assert e2e.parse_args(["--queued", "24", "--concurrency", "8",
                           "--prompts", "8"]).prompts == 8
    plain = e2e.parse_args([])
    assert (plain.queued, plain.prompts) == (0, e2e.FULL["prompts"])
    for bad in (["--queued", "4", "--concurrency", "1,8"], ["--queued", "-1"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_a_queue_gets_engines_of_its_own_concurrency():
    mc = {"plain": [1, 8, 32], "dspine": [1, 8], "dspine-lookup": [8, 32]}
    assert e2e.engine_sets(mc) == [mc]  # waves: one set, max_num_seqs the largest
    assert e2e.engine_sets(mc, queued=32) == [
        {"plain": [1], "dspine": [1]},
        {"plain": [8], "dspine": [8], "dspine-lookup": [8]},
        {"plain": [32], "dspine-lookup": [32]}]
    # Two concurrencies on one engine set cannot both be its max_num_seqs.
    for run in (lambda: engines.run_interleaved({"plain": [1, 8]}, "none", {}, ["greedy"],
                                                8, 1, print, queued=8),
                lambda: engines.run_method("plain", "none", {}, ["greedy"], [1, 8], 8,
                                           print, queued=8)):
        with pytest.raises(ValueError, match="one concurrency"):
            run()


def test_submission_waves_and_queue():
    assert submission(8, 8) == (8, [(0, 8)])
    assert submission(8, 32) == (32, [(0, 32)])                 # cycled up to c
    assert submission(8, 1, prompts_c1=2) == (2, [(0, 1), (1, 2)])
    assert submission(24, 8) == (24, [(0, 8), (8, 16), (16, 24)])  # three waves
    assert submission(8, 8, queued=24) == (24, [(0, 24)])        # one call, cycled
    assert submission(8, 1, prompts_c1=2, queued=3) == (3, [(0, 3)])
    with pytest.raises(ValueError):
        submission(8, 8, queued=4)


class _FakeLLM:
    """`generate` records its calls; request i answers len(prompt) + i tokens."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params)
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=[7] * (len(p["prompt_token_ids"]) + i))]) for i, p in enumerate(prompts)]

    def get_metrics(self):
        return []


def _engine(tmp_path, max_num_seqs):
    eng = Engine.__new__(Engine)  # no vLLM engine: the stand-in's generate
    eng.method, eng.max_num_seqs, eng.llm = "plain", max_num_seqs, _FakeLLM()
    eng.profile_path = str(tmp_path / "no-profile.json")
    return eng


def test_measure_queues_every_request_in_one_call(tmp_path):
    ids = [[1], [1, 2], [1, 2, 3]]
    eng = _engine(tmp_path, max_num_seqs=2)
    row = eng.measure("humaneval", ids, "greedy", 2, 16, prompts_c1=1, queued=7)
    sent = [ids[i % 3] for i in range(7)]
    assert eng.llm.calls == [sent]
    assert (row["prompts"], row["queued"], row["concurrency"]) == (7, 7, 2)
    assert row["tokens"] == sum(len(p) + i for i, p in enumerate(sent))
    assert [len(o) for o in row["outputs"]] == [len(p) + i for i, p in enumerate(sent)]
    assert row["tok_per_s"] == row["tokens"] / row["seconds"]
    # Waves on the same engine: c requests a call, the row says it was not queued.
    eng.llm.calls.clear()
    row = eng.measure("humaneval", ids, "greedy", 2, 16)
    assert [len(c) for c in eng.llm.calls] == [2, 1] and row["queued"] == 0
    assert row["prompts"] == 3
    # A queue on an engine that runs more than c at once would not measure c.
    with pytest.raises(ValueError, match="max_num_seqs 2"):
        _engine(tmp_path, max_num_seqs=8).measure("humaneval", ids, "greedy", 2, 16,
                                                  queued=7)
