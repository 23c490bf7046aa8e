"""Prompt lookup inside the DSpine proposal (`dspine_lookup`, docs/lookup.md) through
vLLM on the distilled tiny pair: greedy output identical to plain decoding, and sampled
output with the target's exact law, while some requests verify the lookup's drafts
(q = 1 at the drafted token) and others the drafter's, in the same steps; requests with
their own seed take the lookup by their own rule, keep the exact law and reproduce their
text whatever the batch.

One engine (dynamic policy with its defaults, the `fair` objective included; the injected
cost model of tests/test_dynamic_engine.py; lookup on with 1-token matches so that nearly
every step has a lookup continuation), shared by the tests through the session registry;
the default tier runs its greedy identity and the 3,000-sample law, the `full` tier the
72,000-sample law and the throughput objective's engine; its step profile
(vllm_dspine/step_profile.py) counts the request-steps whose drafts came from each
source, so the tests see that the lookup was used."""

from __future__ import annotations

import os

import pytest
import torch

from engine_utils import dspine_spec, prompts_of_lengths
from exact_law import Case, check_follows, exact_marginals, load_float64_target
from vllm_dspine import step_profile
from vllm_dspine.serving.metrics import spec_decode_counters

# The lookup is on by default (docs/lookup.md, "Default"), so its engine is in the default
# tier (~42 s to start on a slow core).
pytestmark = [pytest.mark.engine]

# tests/test_dynamic_engine.py's: the policy verifies some drafts of some requests.
INJECTED_COST = {"step_s": 0.02, "token_s": 0.00002, "draft_s": 0.005}
LOOKUP = dict(dspine_lookup=True, dspine_lookup_min=1, dspine_lookup_max=4)


@pytest.fixture(scope="module")
def pair(tiny_trained_pair):
    return tiny_trained_pair  # conftest.py: written once per session


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lookup_profile") / "profile.json")


def _lookup_engine(engines, pair, profile_path, **extra):
    """The lookup engine (with `extra` speculative keys), its step profile at
    `profile_path`: the engine core reads the path from its environment when it starts."""
    os.environ[step_profile.ENV] = profile_path
    try:
        return engines.get(pair.target_dir, dspine_spec(
            pair.draft_dir, dspine_verify_cost=INJECTED_COST, **LOOKUP, **extra))
    finally:
        os.environ.pop(step_profile.ENV, None)


@pytest.fixture
def lookup_llm(engines, pair, profile_path):
    return _lookup_engine(engines, pair, profile_path)


def _counts(path: str) -> dict:
    rec = step_profile.read(path) or {}
    return dict(rec.get("counts") or {})


def _delta(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}


def _greedy_sources(plain_llm, llm, profile_path) -> dict:
    """24 prompts of 3..400 tokens (repetitive text: the lookup finds continuations),
    16..64 new tokens each, through plain decoding and `llm`: asserts the outputs are
    identical and returns `llm`'s step-profile counts for them (drafts by source)."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(24)
    params = [SamplingParams(temperature=0.0, max_tokens=16 + (13 * i) % 49, ignore_eos=True)
              for i in range(len(prompts))]
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    c0 = _counts(profile_path)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert list(a) == list(b), f"prompt {i} ({len(prompts[i])} tokens) differs"
    return _delta(_counts(profile_path), c0)


def _greedy_sources_accepted(plain_llm, llm, profile_path) -> tuple[dict, int]:
    """`_greedy_sources`, and the drafts `llm` accepted meanwhile (vLLM's counter)."""
    m0 = spec_decode_counters(llm)
    c = _greedy_sources(plain_llm, llm, profile_path)
    m1 = spec_decode_counters(llm)
    return c, m1["vllm:spec_decode_num_accepted_tokens"] - m0.get(
        "vllm:spec_decode_num_accepted_tokens", 0)


def test_greedy_identical_with_lookup(plain_llm, lookup_llm, profile_path):
    """Identical to plain decoding (`_greedy_sources`), with both sources verified."""
    c, accepted = _greedy_sources_accepted(plain_llm, lookup_llm, profile_path)
    print(f"greedy with lookup: sources {c}; drafts accepted {accepted}")
    assert c.get("lookup_request_steps", 0) > 0 and c.get("lookup_drafts", 0) > 0, c
    assert accepted > 0


@pytest.mark.full
def test_greedy_identical_with_lookup_and_the_throughput_objective(engines, pair, plain_llm,
                                                                   tmp_path_factory):
    """The same with `dspine_verify_objective: throughput` (docs/dynamic-verification.md,
    "Objective": a batch's lengths by its committed tokens per second, the default until
    2026-12-05): identical to plain decoding, with both sources verified (an engine of its
    own, its own step profile)."""
    path = str(tmp_path_factory.mktemp("lookup_throughput_profile") / "profile.json")
    llm = _lookup_engine(engines, pair, path, dspine_verify_objective="throughput")
    c = _greedy_sources(plain_llm, llm, path)
    print(f"greedy with lookup, throughput objective: sources {c}")
    assert c.get("lookup_request_steps", 0) > 0 and c.get("drafter_request_steps", 0) > 0, c


# The prompt holds "fghijklmnop" before the planted habit's "abcdefg": after the habit's
# "h" the lookup proposes "ijklmnop", which the target mostly continues with.
LOOKUP_CASE = Case("lookup", temperature=0.35, prompt=tuple(b"fghijklmnopabcdefg"))
# Default tier: 3,000 samples (the chi-square detects TV 0.045 at power 0.9 for df 2,
# asserted <= 0.06); full tier 72,000: TV 0.0091-0.0098 for df 2-4, asserted <= 0.01, the
# project's 1 % level (12,000, run once on 2026-12-03, detected only TV 0.022).
FAST_SAMPLES = int(os.environ.get("DSPINE_LOOKUP_SAMPLES_FAST", "3000"))
FULL_SAMPLES = int(os.environ.get("DSPINE_LOOKUP_SAMPLES", "72000"))


@pytest.fixture(scope="module")
def lookup_law(pair):
    # Tokens 2 and 3: with this 18-token prompt the law of token 4 took 44 s to
    # enumerate (measured), most of this module's time.
    return exact_marginals(load_float64_target(pair.target_dir), LOOKUP_CASE, tokens=3)


def _sampled_follows_the_law(llm, law, profile_path, n: int, asserted_tv: float,
                             seeded: bool = False, source: str = "lookup") -> None:
    """n requests of LOOKUP_CASE (each with its own seed 0..n-1 if `seeded`): tokens 2
    and 3 follow `law`, with drafts of `source` (the lookup's, or those of them the
    corpus lookup gave) verified in > n / 10 request-steps."""
    from vllm import TokensPrompt

    c0, m0 = _counts(profile_path), spec_decode_counters(llm)
    params = ([LOOKUP_CASE.sampling_params(max_tokens=6, seed=i) for i in range(n)]
              if seeded else LOOKUP_CASE.sampling_params(max_tokens=6))
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(LOOKUP_CASE.prompt))] * n,
                        params, use_tqdm=False)
    spec = torch.tensor([list(o.outputs[0].token_ids) for o in outs])  # [n, 6]
    c, m1 = _delta(_counts(profile_path), c0), spec_decode_counters(llm)
    drafts = m1["vllm:spec_decode_num_drafts"] - m0.get("vllm:spec_decode_num_drafts", 0)
    accepted = m1["vllm:spec_decode_num_accepted_tokens"] - m0.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    print(f"sampled T={LOOKUP_CASE.temperature} with lookup{', seeded' if seeded else ''}: "
          f"sources {c}; {drafts} "
          f"verifications, {accepted} drafts accepted")
    # Both sources verified, in a good number of request-steps each.
    assert c.get(f"{source}_request_steps", 0) > n // 10, c
    assert accepted > n // 10
    assert spec.shape == (n, 6)
    check_follows("lookup", spec, law, (1, 2), asserted_tv=asserted_tv)


def test_sampled_distribution_is_exact_with_lookup(lookup_llm, lookup_law, profile_path):
    """Tokens 2 and 3 of max_tokens 6 at T 0.35 follow the exact law (tests/exact_law.py;
    p > 1e-3 per position, no token of exact probability 0) with the lookup's drafts
    verified at q = 1: FAST_SAMPLES requests."""
    _sampled_follows_the_law(lookup_llm, lookup_law, profile_path, FAST_SAMPLES, 0.06)


def test_sampled_distribution_is_exact_with_lookup_and_seeds(lookup_llm, lookup_law,
                                                             profile_path):
    """The same with a seed per request: seeded requests take the lookup by their own
    rule (`SeededLengthRule` per source, dynamic.py), FAST_SAMPLES requests."""
    _sampled_follows_the_law(lookup_llm, lookup_law, profile_path, FAST_SAMPLES, 0.06,
                             seeded=True)


def test_seeded_requests_with_lookup_reproduce_whatever_the_batch(lookup_llm, profile_path):
    """Seeded sampled requests on repetitive prompts (the lookup proposes for them)
    give the same tokens alone, again alone, and among 12 other requests (greedy,
    unseeded sampled, other lengths): their sources and lengths read only their own
    tokens and history. The lookup's drafts are verified for them."""
    from vllm import SamplingParams

    prompts = prompts_of_lengths(20)
    seeded = [SamplingParams(temperature=[0.5, 1.0][i % 2], seed=70 + i, max_tokens=48,
                             ignore_eos=True) for i in range(8)]
    others = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=20 + 5 * i,
                             ignore_eos=True) for i in range(12)]
    mine = prompts[:8]

    def tokens(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    c0 = _counts(profile_path)
    alone = tokens(lookup_llm.generate(mine, seeded, use_tqdm=False))
    c = _delta(_counts(profile_path), c0)
    again = tokens(lookup_llm.generate(mine, seeded, use_tqdm=False))
    mixed_prompts = [p for pair in zip(prompts[8:], mine) for p in pair] + prompts[16:]
    mixed_params = [p for pair in zip(others, seeded) for p in pair] + others[8:]
    mixed = tokens(lookup_llm.generate(mixed_prompts, mixed_params, use_tqdm=False))
    print(f"seeded with lookup, alone: sources {c}")
    assert c.get("lookup_request_steps", 0) > 0, c
    assert again == alone
    assert mixed[1:16:2] == alone


@pytest.mark.full
def test_sampled_distribution_is_exact_with_lookup_full(lookup_llm, lookup_law,
                                                        profile_path):
    """The same at FULL_SAMPLES (detects TV 0.01 at power 0.9)."""
    _sampled_follows_the_law(lookup_llm, lookup_law, profile_path, FULL_SAMPLES, 0.01)


@pytest.mark.full
def test_sampled_distribution_is_exact_with_lookup_and_seeds_full(lookup_llm, lookup_law,
                                                                  profile_path):
    """The seeded case at FULL_SAMPLES (detects TV 0.01 at power 0.9)."""
    _sampled_follows_the_law(lookup_llm, lookup_law, profile_path, FULL_SAMPLES, 0.01,
                             seeded=True)


# ---------------------------------------------------------------- the corpus lookup
# (docs/lookup.md "The corpus lookup"): an engine whose lookup also matches a corpus of
# the target's own text, written from plain decoding before it starts: the greedy answers
# to half of `_greedy_sources`' prompts, and LOOKUP_CASE's prompt with sampled
# continuations at its temperature. Its own-context matches are 4 tokens long only, so
# most steps of those requests take the corpus's drafts (no own match, or a corpus match
# of 8 tokens).


_CORPUS: dict = {}  # the corpus file, written once per session (plain_llm is per test)


@pytest.fixture
def corpus_path(plain_llm, tmp_path_factory):
    if "path" in _CORPUS:
        return _CORPUS["path"]
    import numpy as np
    from vllm import SamplingParams, TokensPrompt

    from vllm_dspine.model.lookup_corpus import write_lookup_corpus

    prompts = prompts_of_lengths(24)[:12]
    outs = plain_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64,
                                                      ignore_eos=True), use_tqdm=False)
    texts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    sampled = plain_llm.generate(
        [TokensPrompt(prompt_token_ids=list(LOOKUP_CASE.prompt))] * 200,
        [LOOKUP_CASE.sampling_params(max_tokens=6, seed=10_000 + i) for i in range(200)],
        use_tqdm=False)
    texts += [list(LOOKUP_CASE.prompt) + list(o.outputs[0].token_ids) for o in sampled]
    path = str(tmp_path_factory.mktemp("lookup_corpus") / "corpus.npz")
    write_lookup_corpus([np.array(t) for t in texts], path)
    _CORPUS["path"] = path
    return path


@pytest.fixture
def corpus_llm(engines, pair, corpus_path, tmp_path_factory):
    path = str(tmp_path_factory.getbasetemp() / "corpus_profile.json")
    os.environ[step_profile.ENV] = path
    try:
        llm = engines.get(pair.target_dir, dspine_spec(
            pair.draft_dir, dspine_verify_cost=INJECTED_COST, dspine_lookup=True,
            dspine_lookup_min=4, dspine_lookup_max=4, dspine_lookup_corpus=corpus_path))
    finally:
        os.environ.pop(step_profile.ENV, None)
    return llm, path


def test_greedy_identical_with_the_corpus_lookup(plain_llm, corpus_llm):
    """Identical to plain decoding on all 24 prompts (12 whose answers the corpus holds,
    12 it does not), with the corpus's drafts verified and accepted."""
    llm, path = corpus_llm
    c, accepted = _greedy_sources_accepted(plain_llm, llm, path)
    print(f"greedy with the corpus lookup: sources {c}; drafts accepted {accepted}")
    assert c.get("corpus_request_steps", 0) > 0 and c.get("corpus_drafts", 0) > 0, c
    assert accepted > c["corpus_drafts"] // 4, (accepted, c)


def test_sampled_distribution_is_exact_with_the_corpus_lookup(corpus_llm, lookup_law):
    """LOOKUP_CASE's tokens 2 and 3 follow the exact law with the corpus's drafts (the
    voted continuation of 200 sampled answers, verified at q = 1) in > n / 10
    request-steps: FAST_SAMPLES requests, as for the prompt lookup above."""
    llm, path = corpus_llm
    _sampled_follows_the_law(llm, lookup_law, path, FAST_SAMPLES, 0.06, source="corpus")


@pytest.mark.full
def test_sampled_distribution_is_exact_with_the_corpus_lookup_full(corpus_llm, lookup_law):
    """The same at FULL_SAMPLES (detects TV 0.01 at power 0.9)."""
    llm, path = corpus_llm
    _sampled_follows_the_law(llm, lookup_law, path, FULL_SAMPLES, 0.01, source="corpus")
