"""Dynamic verification through vLLM on CPU, on the distilled tiny pair: fewer drafts
never change the output, the sparse q of a verified prefix is the one drawn, and (`full`
tier, docs/testing.md says why) vLLM's batch-size schedule is exact and the draft KV
stays right through steps that skip the block.

Tiers (docs/testing.md): the default tier keeps the greedy identity with the policy on
an injected cost model (several verified lengths used); the `full` tier adds the sampled
law with the policy (the default tier's sampled law against the exact law is
tests/test_exact_distribution.py's), the greedy identity with the measured cost model
(the default tier runs that model, the default settings, in tests/test_serve.py's
`vllm serve`, whose counters must account for every answer), the schedule and the
retrieval vocabulary.

Engines are expensive (~35 s each on a slow core): they come from the session's registry
(conftest.py: the plain engine and the injected-cost DSpine engine are shared with
tests/test_robust_engine.py and the other modules of the tiny pair; the schedule and
retrieval-vocabulary engines are private to their tests and shut down after them). Each
engine reads its own metrics (the registry's `get_metrics`)."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from engine_utils import (TINY_INJECTED_COST, check_drafts_against_reference, dspine_spec,
                          prompts_of_lengths)
from exact_law import Case, check_follows, exact_marginals, load_float64_target
from vllm_dspine.serving.metrics import spec_decode_counters

pytestmark = pytest.mark.engine

# engine_utils.TINY_INJECTED_COST: at the batch sizes below the policy verifies some
# drafts of some requests, not all or none (and timing does not enter, unlike a measured
# model). The same engine serves tests/test_robust_engine.py.
INJECTED_COST = TINY_INJECTED_COST
SCHEDULE = [[1, 2, 15], [3, 8, 4], [9, 64, 0]]


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


def verified_hist(llm) -> list[int]:
    """vllm:dspine_verified_drafts as counts per verified length 0..15."""
    for m in llm.get_metrics():
        if m.name == "vllm:dspine_verified_drafts":
            cum = [m.buckets[f"{float(n)}"] for n in range(16)]
            return [cum[0]] + [cum[n] - cum[n - 1] for n in range(1, 16)]
    raise AssertionError("no vllm:dspine_verified_drafts metric")


def _delta(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b)]


def _greedy_params(n: int):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=16 + (13 * i) % 49, ignore_eos=True)
            for i in range(n)]


def _greedy_identical(plain_llm, llm, prompts, params) -> None:
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert list(a) == list(b), f"prompt {i} ({len(prompts[i])} tokens) differs"


# ------------------------------------------------- the policy, injected cost model
@pytest.fixture
def dyn_llm(engines, pair):
    return engines.get(pair.target_dir, dspine_spec(pair.draft_dir,
                                                    dspine_verify_cost=INJECTED_COST))


def test_greedy_identical_with_the_policy_choosing_lengths(plain_llm, dyn_llm):
    """24 prompts of 3..400 tokens, 16..64 new tokens each, with the policy on: greedy
    output identical to plain decoding while the verified lengths vary between requests
    and steps (several lengths strictly between 0 and 15 are used)."""
    prompts = prompts_of_lengths(24)
    before = verified_hist(dyn_llm)
    _greedy_identical(plain_llm, dyn_llm, prompts, _greedy_params(len(prompts)))
    hist = _delta(verified_hist(dyn_llm), before)
    print("verified drafts per request-step (length: count):",
          {n: c for n, c in enumerate(hist) if c})
    assert sum(hist) > 0
    assert sum(1 for n in range(1, 15) if hist[n]) >= 3, hist
    assert sum(hist[1:]) > 0


# Tokens 2 and 3 of max_tokens 6 at T 0.35 (at most 5 drafts after the first token:
# a request verifies no more than its max_tokens can use, so the policy still chooses
# among lengths 0-5). Their exact law is enumerated in a few seconds (tests/exact_law.py);
# token 4's took 8 s more on a fast core and ~20 s on a slow one (the module's largest
# setup after its engines; checked until 2026-12-03, pruned mass 5e-4, none ambiguous), at
# T 0.5 90 s.
POLICY_CASE = Case("policy", temperature=0.35)
POLICY_SAMPLES = 6000


@pytest.fixture(scope="module")
def policy_law(pair):
    return exact_marginals(load_float64_target(pair.target_dir), POLICY_CASE, tokens=3)


@pytest.mark.full  # the default tier's sampled law: tests/test_exact_distribution.py
def test_sampled_distribution_is_exact_with_the_policy(dyn_llm, policy_law):
    """At temperature 0.35 the 2nd and 3rd generated tokens (those verification
    produces: accepted drafts of a shortened prefix, corrections, bonus tokens) follow the
    target's exact law (tests/exact_law.py): 6,000 samples of 6 tokens, a chi-square
    goodness-of-fit test per position (p > 1e-3; it detects TV 0.031-0.035 at power 0.9,
    measured over tokens 2-4 when token 4 was checked too; asserted <= 0.04), no token of
    exact probability 0, while the policy verifies prefixes of several lengths.

    The DSpine requests carry no seed of their own (a seeded request keeps the fixed
    length, docs/dynamic-verification.md): their randomness is the engine's global
    generator (engine seed 0), and the policy's cost model is injected, not measured.
    The outcome is still not bit-reproducible: the engine core starts stepping while the
    6,000 requests arrive, so batch composition (and with it the global stream's use)
    varies run to run; with a correct sampler each of the two tests fails with
    probability 1e-3. That the rule itself is exact, and that the tempting rule
    (confidence q_t(v_t) of the drawn token) is not, is checked exactly in
    tests/test_dynamic_policy.py. (Until 2026-12-03: a two-sample test against 4,000
    plain-vLLM samples at T 0.5, sensitive to a few percent of TV.)"""
    from vllm import TokensPrompt

    before_m, before_h = spec_decode_counters(dyn_llm), verified_hist(dyn_llm)
    outs = dyn_llm.generate(
        [TokensPrompt(prompt_token_ids=list(POLICY_CASE.prompt))] * POLICY_SAMPLES,
        POLICY_CASE.sampling_params(max_tokens=6), use_tqdm=False)
    spec = torch.tensor([list(o.outputs[0].token_ids) for o in outs])  # [N, 6]
    after_m, hist = spec_decode_counters(dyn_llm), _delta(verified_hist(dyn_llm), before_h)
    drafts = after_m["vllm:spec_decode_num_drafts"] - before_m.get(
        "vllm:spec_decode_num_drafts", 0)
    per_pos = [x - y for x, y in zip(
        after_m["vllm:spec_decode_num_accepted_tokens_per_pos"],
        before_m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * 15)]
    print(f"sampled T={POLICY_CASE.temperature}: {drafts} verifications, acceptance at "
          f"position 1 {per_pos[0] / max(drafts, 1):.3f}; verified lengths "
          f"{ {k: c for k, c in enumerate(hist) if c} }")
    assert per_pos[0] / drafts > 0.1, "too few drafts accepted for a meaningful test"
    assert sum(1 for k in range(16) if hist[k]) >= 3 and sum(hist[1:]) > 100, hist
    assert spec.shape == (POLICY_SAMPLES, 6)
    check_follows("policy", spec, policy_law, (1, 2), asserted_tv=0.04)


# ------------------------------------------------- the policy, measured cost model
@pytest.mark.full  # an engine of its own (~37 s on a slow core); docstring above
def test_greedy_identical_with_the_measured_policy(engines, pair, plain_llm):
    """The default settings (cost measured on this engine while it runs): greedy output
    identical to plain decoding for 24 prompts (float32: whatever lengths the policy
    picks, the output is the target's greedy one); the histogram records every decode
    request-step. Which lengths the measured cost model picks is tested without an
    engine (tests/test_dynamic_policy.py, `test_measured_cost_*`)."""
    llm = engines.get(pair.target_dir, dspine_spec(pair.draft_dir))
    prompts = prompts_of_lengths(24)
    params = _greedy_params(len(prompts))
    before = verified_hist(llm)  # the engine is shared: its earlier requests are not these
    _greedy_identical(plain_llm, llm, prompts, params)
    hist = _delta(verified_hist(llm), before)
    print("measured policy, verified drafts per request-step:",
          {n: c for n, c in enumerate(hist) if c})
    # A request's first token comes from its prefill; the rest take at least one
    # request-step per 16 tokens.
    assert sum(hist) >= sum(p.max_tokens - 1 for p in params) // 16


# ------------------------------------------------- vLLM's batch-size schedule
@pytest.mark.full  # an engine of its own (~30 s)
def test_batch_size_schedule_is_exact(engines, pair, plain_llm, tmp_path):
    """`num_speculative_tokens_per_batch_size` [[1, 2, 15], [3, 8, 4], [9, 64, 0]] with
    the fixed length: 12 requests of different lengths finish one by one, so the batch
    shrinks through all three ranges. Every request-step verifies exactly the schedule's
    count (histogram only at 0, 4 and 15, each used); greedy output equals plain; and
    the drafts of steps after steps that drafted nothing (the block forward skipped,
    only the draft context K/V written) equal the reference drafter's on the committed
    text, so the draft KV stayed right."""
    from vllm import SamplingParams

    dump_dir = str(tmp_path / "dump")
    os.makedirs(dump_dir)
    prompts = prompts_of_lengths(12, longest=80)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True)
              for i in range(len(prompts))]
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    with engines.private(pair.target_dir, dspine_spec(
            pair.draft_dir, dspine_verify="fixed", dspine_draft_gemm="fp32",
            num_speculative_tokens_per_batch_size=SCHEDULE), dump_dir=dump_dir) as llm:
        before = verified_hist(llm)
        outs = llm.generate(prompts, params)
        hist = _delta(verified_hist(llm), before)
    for i, (a, o) in enumerate(zip(plain, outs)):
        assert list(a) == list(o.outputs[0].token_ids), f"prompt {i} differs"
    print("schedule, verified drafts per request-step:",
          {n: c for n, c in enumerate(hist) if c})
    assert all(c == 0 for n, c in enumerate(hist) if n not in (0, 4, 15)), hist
    assert hist[0] > 0 and hist[4] > 0 and hist[15] > 0, hist
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    checked, rows = check_drafts_against_reference(pair, dump_dir, seqs)
    assert checked >= 8, f"only {checked} drafting steps were checked"
    # The schedule's 4-draft steps drafted a 5-row block, the 15-draft steps all 16 rows.
    assert set(rows) == {4, 15}, sorted(set(rows))


# ------------------------------------------------- a drafter's retrieval vocabulary
@pytest.mark.full
def test_retrieval_vocab_restricts_the_candidates(engines, pair, plain_llm, tmp_path):
    """A drafter whose config.json lists `retrieval_vocab` (two thirds of the ids):
    every candidate of every step is one of them, the candidates and greedy drafts equal
    the reference retrieval over those head rows, and greedy output equals plain.
    (`full` tier: an engine of its own, ~30 s; in the default tier the SmolLM2 drafter,
    which has a retrieval vocabulary, is served by tests/test_smollm2_pair.py.)"""
    import json
    import shutil

    from vllm import SamplingParams

    draft = tmp_path / "draft"
    shutil.copytree(pair.draft_dir, draft)
    cfg = json.loads((draft / "config.json").read_text())
    vocab = [i for i in range(cfg["vocab_size"]) if i % 3]
    cfg["dspine_config"]["retrieval_vocab"] = vocab
    (draft / "config.json").write_text(json.dumps(cfg))
    dump_dir = str(tmp_path / "dump")
    os.makedirs(dump_dir)
    prompts = prompts_of_lengths(6, longest=60)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    with engines.private(pair.target_dir, dspine_spec(str(draft), dspine_verify="fixed",
                                                      dspine_draft_gemm="fp32"),
                         dump_dir=dump_dir) as llm:
        outs = llm.generate(prompts, params)
    for i, (a, o) in enumerate(zip(plain, outs)):
        assert list(a) == list(o.outputs[0].token_ids), f"prompt {i} differs"
    allowed = torch.tensor(vocab)
    dumps = sorted(glob.glob(os.path.join(dump_dir, "*.pt")))
    assert dumps
    for path in dumps:
        assert torch.isin(torch.load(path)["cand_ids"], allowed).all(), path
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in outs}
    checked, _ = check_drafts_against_reference(pair, dump_dir, seqs, vocab=allowed)
    assert checked >= 6, f"only {checked} drafting steps were checked"
